"""core/runtime.py on a CPU machine: the CUDA branches with only the driver calls faked, and rank-0-alone failures.

    python -m pytest tests/test_runtime.py
    python -m pytest tests/test_runtime.py -m "not slow"    # the faked-driver tests only, ~1 s

The fakes replace what a CUDA build would ask the driver (is_available, device_count, _cuda_setDevice,
get_device_name, get_device_capability) and, under torchrun, torch.distributed's NCCL group creation,
which a CPU build cannot run. Every function of this project runs unchanged. The expected peak FLOP/s
are the NVIDIA datasheets' figures, written out here (tensor-core figures are quoted with sparsity;
the dense figure is half of it), not read from the code's table.
"""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from core import runtime
from core.errors import UserError
from tests.helpers import (ONE_THREAD_ENV, REPO_ROOT, TINY_TRAIN, assert_user_error, char_data_fixture, cli_args,
                           fake_cpu, run_scripts)

SM = {"V100": (7, 0), "A100": (8, 0), "H100": (9, 0)}


@pytest.fixture
def fake_gpus(monkeypatch):  # the flags train.py sets on CUDA: restored by conftest.py after each test
    """A CUDA machine with `count` GPUs of compute capability `capability`, as far as the driver calls
    go. Returns the record of the calls, in order."""
    calls = []

    def install(count=2, capability=(9, 0), name="NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch._C, "_cuda_setDevice", lambda index: calls.append(("set_device", index)),
                            raising=False)

        def get_capability(device=None):
            calls.append(("capability", str(device)))
            return capability
        monkeypatch.setattr(torch.cuda, "get_device_capability", get_capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(key, raising=False)
        return calls
    return install


@pytest.fixture
def fake_nccl(monkeypatch):
    """torchrun's process group creation, recorded instead of run (a CPU build has no NCCL)."""
    groups = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: groups.append(("default", kw)))
    monkeypatch.setattr(dist, "new_group", lambda **kw: groups.append(("new", kw)) or f"group{len(groups)}")
    return groups


def torchrun_env(monkeypatch, rank, local_rank, world_size):
    for key, value in dict(RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=world_size).items():
        monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize("asked, expected", [("auto", "cuda:0"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1")])
def test_setup_single_process_gives_an_indexed_device_and_sets_it(fake_gpus, asked, expected):
    calls = fake_gpus(count=2)
    rt = runtime.setup(asked, "auto")  # "cuda" once crashed here: set_device("cuda") needs an index
    assert (rt.device, rt.device_type, rt.world_size) == (expected, "cuda", 1)
    index = int(expected[-1])
    assert calls[0] == ("set_device", index)  # before the dtype probe, which would open a context on GPU 0
    assert ("capability", expected) in calls
    assert rt.dtype == "bfloat16"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # restored after


def test_setup_a_missing_gpu_is_one_line(fake_gpus):
    fake_gpus(count=2)
    with pytest.raises(UserError, match="device 'cuda:2' does not exist: this machine has 2 CUDA device"):
        runtime.setup("cuda:2")
    with pytest.raises(UserError, match="unknown device 'cuda:x'"):
        runtime.setup("cuda:x")


@pytest.mark.parametrize("asked", ["auto", "cuda"])
def test_setup_under_torchrun_uses_the_local_rank_gpu(fake_gpus, fake_nccl, monkeypatch, asked):
    calls = fake_gpus(count=4)
    torchrun_env(monkeypatch, rank=5, local_rank=1, world_size=8)
    rt = runtime.setup(asked, "auto", timeout_s=30)
    assert (rt.device, rt.rank, rt.local_rank, rt.world_size) == ("cuda:1", 5, 1, 8)
    assert calls[0] == ("set_device", 1) and ("capability", "cuda:1") in calls
    (kind, kw), *rest = fake_nccl
    assert kind == "default" and kw["backend"] == "nccl" and kw["device_id"] == torch.device("cuda:1")
    assert kw["timeout"].total_seconds() == 30
    # two host-side gloo groups: flags with the same timeout, rank 0's saves with a long one
    assert [(k, g["backend"], g["timeout"].total_seconds()) for k, g in rest] == [
        ("new", "gloo", 30), ("new", "gloo", runtime.MASTER_WORK_TIMEOUT.total_seconds())]


def test_setup_under_torchrun_refuses_another_ranks_gpu(fake_gpus, fake_nccl, monkeypatch):
    fake_gpus(count=4)
    torchrun_env(monkeypatch, rank=1, local_rank=1, world_size=2)
    with pytest.raises(UserError, match="each process uses its own GPU"):
        runtime.setup("cuda:0")


def test_local_rank_beyond_the_visible_gpus(fake_gpus, fake_nccl, monkeypatch):
    """Several visible GPUs and a LOCAL_RANK past them: one line. One visible GPU (a scheduler's
    one GPU per task): that GPU."""
    fake_gpus(count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    torchrun_env(monkeypatch, rank=3, local_rank=3, world_size=4)
    with pytest.raises(UserError, match=r"LOCAL_RANK=3 but only 2 CUDA devices are visible \(CUDA_VISIBLE_DEVICES=0,1\)"
                                        r".*--nproc_per_node=2"):
        runtime.setup("auto")
    calls = fake_gpus(count=1)
    torchrun_env(monkeypatch, rank=3, local_rank=3, world_size=4)
    rt = runtime.setup("auto")
    assert rt.device == "cuda:0" and calls[0] == ("set_device", 0)


@pytest.mark.parametrize("gpu, expected", [("A100", "bfloat16"), ("H100", "bfloat16"), ("V100", "float16")])
def test_auto_dtype_is_bf16_only_where_it_is_native(fake_gpus, monkeypatch, gpu, expected):
    """V100 (sm70) emulates bfloat16 and torch.cuda.is_bf16_supported() says yes anyway: float16 with
    loss scaling is right there."""
    fake_gpus(count=1, capability=SM[gpu], name=f"Tesla {gpu}")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    rt = runtime.setup("cuda", "auto")
    assert rt.dtype == expected
    assert rt.grad_scaler().is_enabled() == (expected == "float16")


def test_explicit_bf16_on_an_sm70_gpu_is_one_line(fake_gpus):
    fake_gpus(count=1, capability=(7, 0), name="Tesla V100-SXM2-16GB")
    with pytest.raises(UserError, match=r"Tesla V100-SXM2-16GB \(sm70\) has no native bfloat16.*--dtype=float16"):
        runtime.setup("cuda", "bfloat16")
    assert runtime.setup("cuda", "float16").dtype == "float16"


@pytest.mark.parametrize("capability, flags, isa, expected", [
    ("AVX2", {"avx2", "fma"}, None, "float32"),                        # most laptops and desktops
    ("AVX512", {"avx512f", "avx512bw"}, None, "float32"),              # Skylake-X: AVX-512, no bf16 units
    ("AVX512", {"avx512f", "avx512_bf16"}, None, "bfloat16"),          # Zen 4, Cooper Lake
    ("AVX512", {"avx512f", "amx_bf16"}, None, "bfloat16"),             # Sapphire Rapids
    ("AVX2", {"avx512f", "avx512_bf16"}, None, "float32"),             # Zen 4 under ATEN_CPU_CAPABILITY=avx2
    ("AVX512", {"avx512f", "avx512_bf16"}, "AVX2", "float32"),         # ... or ONEDNN_MAX_CPU_ISA=AVX2
    ("DEFAULT", {"fp", "asimd", "bf16"}, None, "bfloat16"),            # ARM with BF16 (Graviton 3)
])
def test_auto_dtype_on_a_cpu_is_bf16_autocast_only_where_it_is_native(monkeypatch, capability, flags, isa, expected):
    """The rule CUDA follows: --dtype=auto is bfloat16 where the CPU computes it natively, else float32.
    bf16 is autocast over the forward (a CPU autocast context), no GradScaler; float32 runs as is."""
    fake_cpu(monkeypatch, capability, flags, isa)
    rt = runtime.setup("cpu", "auto")
    assert rt.dtype == expected and not rt.grad_scaler().is_enabled()
    with rt.autocast():
        assert torch.is_autocast_enabled("cpu") == (expected == "bfloat16")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 or expected == "float32"
    assert runtime.setup("cpu", "float32").dtype == "float32"


def test_explicit_bf16_on_a_cpu_is_allowed_only_where_it_is_native(monkeypatch):
    fake_cpu(monkeypatch, "AVX512", {"avx512f", "avx512_bf16"})
    assert runtime.setup("cpu", "bfloat16").dtype == "bfloat16"
    fake_cpu(monkeypatch, "AVX2", {"avx2", "fma"})
    with pytest.raises(UserError, match=r"^dtype bfloat16 is not supported on this CPU: it has no native bfloat16 "
                                        r"\(.*torch's kernels: AVX2\).*emulated.*use --dtype=float32 or --dtype=auto$"):
        runtime.setup("cpu", "bfloat16")
    for native in ({"avx2"}, {"avx512_bf16"}):  # float16 needs loss scaling, which runs on CUDA only
        fake_cpu(monkeypatch, "AVX512", native)
        with pytest.raises(UserError, match=r"^dtype float16 is not supported on cpu.*--dtype=auto"):
            runtime.setup("cpu", "float16")
    with pytest.raises(UserError, match="unknown dtype 'float64'; use float32, bfloat16, float16 or auto"):
        runtime.setup("cpu", "float64")


@pytest.mark.slow
def test_avx2_emulation_chooses_float32_and_refuses_bf16():
    """Under scripts/cpu_capabilities.sh's avx2 variables a native-bf16 CPU answers as an AVX2 one:
    --dtype=auto is float32, and train.py --dtype=bfloat16 is one line, exit 2 (on any CPU)."""
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    probe = "import torch; from core import runtime; print(runtime.setup('cpu').dtype, torch.backends.cpu.get_cpu_capability())"
    choice, refusal = run_scripts(["-c", probe], ["train.py", "--device=cpu", "--dtype=bfloat16"], env=env)
    assert choice.returncode == 0 and choice.stdout.split() == ["float32", "AVX2"], choice
    assert_user_error(refusal, "dtype bfloat16 is not supported on this CPU", "use --dtype=float32 or --dtype=auto")


def test_cpu_peak_for_mfu_is_measured_in_the_runs_dtype(monkeypatch):
    """A bf16 run's MFU is against a bf16 matmul's rate: float32's (several times slower where bf16 is
    native) would overstate it. (A small matmul here: bf16 emulated on an AVX2 CPU is far slower,
    docs/performance.md's Machines.)"""
    seen, measure = [], runtime.cpu_matmul_peak_flops
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: seen.append(a.dtype) or torch.mm(a, b))
    monkeypatch.setattr(runtime, "cpu_matmul_peak_flops", lambda **kw: measure(n=64, **kw))
    for dtype in ("float32", "bfloat16"):
        peak, source = runtime.peak_flops_with_source(runtime.Runtime("cpu", "cpu", dtype))
        assert peak > 0 and f"measured {dtype} 1024x1024 matmul" in source
    assert seen == [torch.float32] * 11 + [torch.bfloat16] * 11, seen
    seen.clear()  # a dtype the CPU only emulates: as many timed matmuls as fit in budget_s, not 10
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: seen.append(time.sleep(0.3)) or torch.mm(a, b))
    assert measure(n=64) > 0 and len(seen) == 1 + 4


# Dense peak FLOP/s, NVIDIA datasheets: BF16 and TF32 are quoted "with sparsity" (x2), FP32 is plain.
DATASHEET = {
    "NVIDIA H100 80GB HBM3": (989.5e12, 494.5e12),    # H100 SXM5: BF16 1,979*, TF32 989*
    "NVIDIA H100 PCIe": (756.5e12, 378e12),           # H100 PCIe: BF16 1,513*, TF32 756*
    "NVIDIA H100 NVL": (835.5e12, 417.5e12),          # H100 NVL: BF16 1,671*, TF32 835*
    "NVIDIA H200": (989.5e12, 494.5e12),              # H200 SXM: BF16 1,979*, TF32 989*
    "NVIDIA H200 NVL": (835.5e12, 417.5e12),          # H200 NVL: BF16 1,671*, TF32 835*
    "NVIDIA A100-SXM4-80GB": (312e12, 156e12),        # A100: BF16 624*, TF32 312*
    "NVIDIA A100 80GB PCIe": (312e12, 156e12),
}


@pytest.mark.parametrize("name", list(DATASHEET))
def test_peak_flops_from_the_datasheet(fake_gpus, name):
    fake_gpus(count=1, name=name)
    bf16, tf32 = DATASHEET[name]
    assert runtime.peak_flops_with_source(runtime.Runtime("cuda:0", "cuda", "bfloat16"))[0] == pytest.approx(bf16)
    torch.backends.cuda.matmul.allow_tf32 = True  # as setup() leaves it
    peak, source = runtime.peak_flops_with_source(runtime.Runtime("cuda:0", "cuda", "float32"))
    assert peak == pytest.approx(tf32) and "tf32" in source and name in source


def test_peak_flops_float32_without_tf32_is_the_plain_figure(fake_gpus):
    fake_gpus(count=1, name="NVIDIA H100 80GB HBM3")
    torch.backends.cuda.matmul.allow_tf32 = False
    peak, _ = runtime.peak_flops_with_source(runtime.Runtime("cuda:0", "cuda", "float32"))
    assert peak == pytest.approx(67e12)  # FP32 67 TF


@pytest.mark.parametrize("name, why", [("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "MIG slice"),
                                       ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "MIG slice"),
                                       ("NVIDIA GeForce RTX 4090", "no datasheet figure")])
def test_no_mfu_for_a_mig_slice_or_an_unknown_gpu(fake_gpus, name, why):
    fake_gpus(count=1, name=name)
    for dtype in ("bfloat16", "float32"):
        peak, source = runtime.peak_flops_with_source(runtime.Runtime("cuda:0", "cuda", dtype))
        assert peak is None and why in source and "MFU not reported" in source


def test_mig_uuid_in_cuda_visible_devices_is_a_slice(fake_gpus, monkeypatch):
    fake_gpus(count=1, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4f9e2b7c-0000-5a3e-9a71-1c2d3e4f5a6b")
    assert runtime.peak_flops_with_source(runtime.Runtime("cuda:0", "cuda", "bfloat16"))[0] is None


# --- rank 0 alone fails or is slow: torchrun, 2 gloo processes on the CPU --------------------------

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor-interval=0.1")
TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60
DDP_RUN = TINY_TRAIN | dict(gradient_accumulation_steps=2, max_iters=10**6, lr_decay_iters=100, log_interval=1,
                            eval_interval=10**6, checkpoint_interval=4, dropout=0.1)

# train.py with rank 0's first checkpoint write taking SLEEP seconds: a slow filesystem.
SLOW_FIRST_SAVE = '''
import sys, time
sys.path.insert(0, {repo!r})
import train
from core.errors import run_cli
from core.training import checkpointing

real_save, slept = checkpointing.save_checkpoint, []
def slow_save(*args, **kwargs):
    if not slept:
        slept.append(time.sleep({sleep}))
    return real_save(*args, **kwargs)
checkpointing.save_checkpoint = slow_save
run_cli(train.main)
'''


def start_torchrun(script, tmp_path, name, **cfg) -> subprocess.Popen:
    argv = cli_args(DDP_RUN | cfg)
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, *TORCHRUN, str(script), *argv], cwd=REPO_ROOT, stdout=out, stderr=err,
                                env=os.environ | ONE_THREAD_ENV)


def finish(job: subprocess.Popen, timeout: float) -> None:
    from tests.helpers import child_pids
    try:
        job.wait(timeout=timeout)
    finally:
        if job.poll() is None:
            workers = child_pids(job.pid)
            job.kill()
            for pid in workers:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            job.wait()


data_dir = char_data_fixture(TEXT)


@pytest.mark.slow
def test_rank0_write_failure_stops_every_rank_at_once_with_the_same_line(tmp_path, data_dir):
    """Rank 0 cannot write its checkpoint (ckpt.pt is a directory). Both ranks stop with the same
    one-line error and exit 2, within seconds: long before dist_timeout_s, and without a traceback."""
    out = tmp_path / "out"
    (out / "ckpt.pt").mkdir(parents=True)
    (out / "ckpt.pt" / "keep").write_text("a directory in the way\n")
    started = time.monotonic()
    job = start_torchrun("train.py", tmp_path, "fail", out_dir=out, data_dir=data_dir, dist_timeout_s=120.0,
                         overwrite=True)  # past the refusal to replace what looks like a checkpoint
    finish(job, timeout=100)
    assert time.monotonic() - started < 60  # imports and 4 steps included; a timeout would take 120 s
    stderr = (tmp_path / "fail.err").read_text()
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0] == errors[1], stderr[-3000:]
    assert errors[0].startswith(f"error: could not save a checkpoint in {out}"), errors
    assert 'train.py", line' not in stderr and 'core/runtime.py", line' not in stderr, stderr[-3000:]
    assert job.returncode != 0
    assert "exitcode  : 2" in stderr  # the user error's exit status, not a kill or a timeout


@pytest.mark.slow
def test_slow_rank0_save_and_sigterm_to_one_rank(tmp_path, data_dir):
    """Rank 0's first save takes 8 s, past dist_timeout_s (4 s): the other rank waits for it without a
    timeout. Then SIGTERM reaches rank 1 only: both ranks stop at the same iteration, rank 0 saves once,
    and the job exits 0. The ranks drew different dropout masks: their RNG states differ."""
    from tests.helpers import child_pids, process_env

    script = tmp_path / "slow_first_save.py"
    script.write_text(SLOW_FIRST_SAVE.format(repo=str(REPO_ROOT), sleep=8))
    out = tmp_path / "out"
    job = start_torchrun(script, tmp_path, "slow", out_dir=out, data_dir=data_dir, dist_timeout_s=4.0)
    try:
        deadline = time.monotonic() + 120
        while "saved checkpoint at iter 4" not in (tmp_path / "slow.out").read_text():
            assert job.poll() is None, (tmp_path / "slow.err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # a few more steps
        workers = {int(process_env(pid).get("RANK", -1)): pid for pid in child_pids(job.pid)}
        os.kill(workers[1], 15)
    finally:
        finish(job, timeout=60)
    stdout, stderr = (tmp_path / "slow.out").read_text(), (tmp_path / "slow.err").read_text()
    assert job.returncode == 0, stderr[-3000:]
    from core.weights.checkpoint import load_checkpoint
    state = load_checkpoint(out / "ckpt.pt")
    stopped = state["meta"]["iter_num"]
    assert stopped > 4 and stdout.count("(stopped by a signal to another process)") == 1, stdout
    assert f"stopped at iter {stopped};" in stdout
    assert not torch.equal(state["rng"]["cpu"][0], state["rng"]["cpu"][1])  # dropout seeded per rank


def test_resume_memory_maps_the_checkpoint(tmp_path, data_dir, monkeypatch):
    """Every rank loads the checkpoint on resume: mmap=True reads tensors from the file as they are
    used instead of copying the whole file into each process's memory."""
    from core.weights import checkpoint
    from tests.helpers import train_tiny
    train_tiny(tmp_path, data_dir, max_iters=2)
    real_load, seen = torch.load, []
    monkeypatch.setattr(torch, "load", lambda *a, **kw: seen.append(kw) or real_load(*a, **kw))
    checkpoint.load_latest(tmp_path)
    assert seen and seen[0].get("mmap") is True


# --- the training loop's timing and syncs ---------------------------------------------------------

def test_step_time_excludes_eval_and_save(tmp_path, data_dir, monkeypatch):
    """An eval and a save that take 0.4 s each do not show in the next step's ms (item: the step
    after an eval or a save counted their time in its ms, tok/s and MFU)."""
    import train
    from tests.helpers import train_tiny
    real_eval, real_save = train.estimate_loss, train.checkpointing.save_checkpoint

    def slow_eval(*args):
        time.sleep(0.4)
        return real_eval(*args)

    def slow_save(*args, **kwargs):
        time.sleep(0.4)
        return real_save(*args, **kwargs)
    monkeypatch.setattr(train, "estimate_loss", slow_eval)
    monkeypatch.setattr(train.checkpointing, "save_checkpoint", slow_save)
    train_tiny(tmp_path, data_dir, max_iters=8, eval_interval=4, log_interval=1)
    from tests.helpers import records
    ms = {r["iter"]: r["ms"] for r in records(tmp_path) if "ms" in r}
    assert sorted(ms) == list(range(8))
    assert ms[4] < 300 and ms[0] < 300, ms  # iteration 4 follows an eval and a save


def test_next_batch_is_prefetched_across_steps_and_loss_synced_only_to_log(tmp_path, data_dir, monkeypatch):
    """After an iteration's forward and backward, the next iteration's first micro-batch is already
    fetched (and used as is); the global loss is computed only on logging iterations."""
    from core.data.loader import TrainBatches
    from core.training import loop
    from tests.helpers import train_tiny
    real_get, real_mean = TrainBatches.get, loop.global_mean
    seen, means = [], []

    def spy_get(batches, iter_num, micro):
        if micro == 0 and iter_num > 0:  # fetched during the previous iteration's last micro-step
            key, (x, _) = batches.ahead
            assert key == (iter_num, 0)
            assert real_get(batches, iter_num, 0)[0] is x  # handed out, not fetched again
            seen.append(iter_num)
        return real_get(batches, iter_num, micro)
    monkeypatch.setattr(TrainBatches, "get", spy_get)
    monkeypatch.setattr(loop, "global_mean", lambda *a: means.append(1) or real_mean(*a))
    train_tiny(tmp_path, data_dir, max_iters=20, log_interval=5, gradient_accumulation_steps=2)
    assert seen == list(range(1, 20)) and len(means) == 4


# --- threads ----------------------------------------------------------------------------------------

def test_threads_are_set_once_in_setup_and_each_script_passes_its_key(monkeypatch, tmp_path):
    """--threads=N sets torch's CPU threads in runtime.setup (0 leaves torch's own count, a negative count is
    one line); train.py, sample.py and eval.py each pass their --threads there."""
    import eval as evallib
    import sample
    import train
    from core.errors import UserError
    from tests.helpers import run_main

    before = torch.get_num_threads()
    try:
        runtime.setup("cpu", "float32", threads=2)
        assert torch.get_num_threads() == 2
        runtime.setup("cpu", "float32", threads=0)
        assert torch.get_num_threads() == 2  # 0: as it was
        with pytest.raises(UserError, match="threads must be 0"):
            runtime.setup("cpu", "float32", threads=-1)
    finally:
        torch.set_num_threads(before)
    seen = []

    def record_then_stop(device, dtype, *args, threads=0, **kwargs):
        seen.append(threads if not args[1:] else args[1])
        raise UserError("stop here")
    monkeypatch.setattr(runtime, "setup", record_then_stop)
    for main, default in ((train.main, 0), (sample.main, 0), (evallib.main, 0)):  # torch's own choice
        for argv, expected in (([], default), (["--threads=3"], 3)):
            assert run_main(main, [f"--out_dir={tmp_path}", *argv]).returncode == 2
            assert seen.pop() == expected, main.__module__
