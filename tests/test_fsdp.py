"""FSDP2 sharding, sharded checkpoints and activation checkpointing, on the CPU with gloo.

    python -m pytest tests/test_fsdp.py                 # ~1 min on two busy CPU cores
    python -m pytest tests/test_fsdp.py -m "not slow"   # the in-process ones, a few seconds

The slow tests launch real `torchrun --nproc_per_node=2 train.py` jobs (gloo, a tiny float32 model)
and compare their per-iteration losses from log.jsonl. Batches depend only on (seed, iteration,
micro-batch index in the global batch), so runs on any number of processes see the same data: only
the order of float additions differs, hence approx where world sizes differ and == where they do not.
"""
import contextlib
import errno
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks import common, memory as bench_memory
from core.errors import UserError
from core.training import checkpointing, parallel
from core.weights import checkpoint
from model import GPT, GPTConfig
from tests.helpers import (ONE_THREAD_ENV, REPO_ROOT, TINY_TRAIN, assert_user_error, char_data_fixture, child_pids, process_env,
                           cli_args, losses, make_char_dataset, run_main, run_scripts, train_tiny)

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
# 2 Blocks (two fully_shard units and the root); 4 micro-batches per step, 2 per process under torchrun.
RUN = dict(n_layer=2, n_head=2, n_embd=32, gradient_accumulation_steps=4, batch_size=4, max_iters=20,
           lr_decay_iters=20, log_interval=1, eval_interval=20, eval_iters=3, checkpoint_interval=10,
           dist_timeout_s=60.0)


def argv(out_dir, data_dir, **cfg) -> list[str]:
    return cli_args(TINY_TRAIN | RUN | {"out_dir": out_dir, "data_dir": data_dir} | cfg)


def assert_close(a: dict, b: dict, iters) -> None:
    assert sorted(a) == sorted(b) == list(iters), (sorted(a), sorted(b))
    for it in iters:  # another order of float additions across processes: rounding only
        assert a[it] == pytest.approx(b[it], rel=1e-4, abs=1e-5), (it, a[it], b[it])


def checked(results) -> list[subprocess.CompletedProcess]:
    for r in results:
        assert r.returncode == 0, f"{r.args}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return results


data_dir = char_data_fixture(TEXT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """Three runs of the same 20 iterations, at once: 2-process fsdp (with activation checkpointing),
    2-process ddp, and 1 process with parallel=fsdp (plain training). Each saves at 10 and 20."""
    root = tmp_path_factory.mktemp("runs")
    out = {name: root / name for name in ("fsdp2", "ddp2", "fsdp1")}
    checked(run_scripts([*TORCHRUN, "train.py", *argv(out["fsdp2"], data_dir, parallel="fsdp",
                                                      activation_checkpointing=True)],
                        [*TORCHRUN, "train.py", *argv(out["ddp2"], data_dir)],
                        ["train.py", *argv(out["fsdp1"], data_dir, parallel="fsdp")], timeout=300))
    return out


@pytest.mark.slow
def test_two_process_fsdp_equals_one_process_and_ddp(runs):
    assert_close(dict(losses(runs["fsdp2"])), dict(losses(runs["fsdp1"])), range(20))
    assert_close(dict(losses(runs["fsdp2"])), dict(losses(runs["ddp2"])), range(20))
    # The shards of the two processes assemble into the whole model (what sample.py reads), equal to ddp's.
    sharded = checkpoint.load_checkpoint(runs["fsdp2"] / checkpoint.SHARDED_NAME)
    full = checkpoint.load_checkpoint(runs["ddp2"] / checkpoint.CKPT_NAME)
    assert sharded["meta"]["iter_num"] == full["meta"]["iter_num"] == 20
    assert sharded["model"].keys() == full["model"].keys()
    for name, tensor in full["model"].items():
        mine = sharded["model"][name]
        if name.endswith("attn.c_attn.bias"):
            # The key bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by
            # all keys), so AdamW turns rounding noise into steps: ~1e-4 apart between any two runs.
            key = slice(mine.numel() // 3, 2 * mine.numel() // 3)
            torch.testing.assert_close(mine[key], tensor[key], rtol=0, atol=1e-3, msg=name)
            mine, tensor = mine.clone(), tensor.clone()
            mine[key] = tensor[key] = 0
        torch.testing.assert_close(mine, tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert sorted(p.name for p in (runs["fsdp2"] / checkpoint.SHARDED_NAME).glob("__*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # one file of shards per process
    assert read_json_meta(runs["fsdp2"] / checkpoint.PREV_SHARDED_NAME)["iter_num"] == 10  # the previous one kept


def read_json_meta(path: Path) -> dict:
    return json.loads((path / checkpoint.META_NAME).read_text())["meta"]


def saved_iter(path: Path) -> int:
    """The iteration of the checkpoint at path while a run is saving: -1 between its two renames (the newest
    one is then ckpt.prev.dcp, for a moment), when the file is not there."""
    try:
        return read_json_meta(path)["iter_num"]
    except FileNotFoundError:
        return -1


def from_iter_10(src: Path, dst: Path) -> Path:
    """A copy of src's iteration-10 checkpoint (ckpt.prev.dcp) as the newest one of a new out_dir."""
    dst.mkdir()
    shutil.copytree(src / checkpoint.PREV_SHARDED_NAME, dst / checkpoint.SHARDED_NAME)
    shutil.copy(src / "log.jsonl", dst / "log.jsonl")
    return dst


@pytest.mark.slow
def test_resume_two_processes_into_one_and_one_into_two(runs, data_dir, tmp_path):
    """Iteration 10 of the 2-process run resumes on 1 process, and of the 1-process run on 2; each
    finishes the last 10 iterations as the uninterrupted runs did, saying that the world size changed."""
    two_to_one = from_iter_10(runs["fsdp2"], tmp_path / "2to1")
    one_to_two = from_iter_10(runs["fsdp1"], tmp_path / "1to2")
    resume = dict(parallel="fsdp", init_from="resume")
    a, b = checked(run_scripts(["train.py", *argv(two_to_one, data_dir, **resume)],
                               [*TORCHRUN, "train.py", *argv(one_to_two, data_dir, **resume)], timeout=300))
    assert "saved by 2 process(es) and resumes on 1" in a.stdout, a.stdout
    assert "saved by 1 process(es) and resumes on 2" in b.stdout, b.stdout
    assert_close(dict(losses(two_to_one)), dict(losses(runs["fsdp2"])), range(20))
    assert_close(dict(losses(one_to_two)), dict(losses(runs["fsdp1"])), range(20))


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's workers one by one, then torchrun."""
    for pid in child_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=30)


def wait_until(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the job ended before the kill"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def kill_worker(proc: subprocess.Popen, rank: int) -> None:
    """SIGKILL one of torchrun's workers; torchrun (--max-restarts) stops the other and restarts both."""
    workers = {int(process_env(pid).get("RANK", -1)): pid for pid in child_pids(proc.pid)}
    os.kill(workers[rank], signal.SIGKILL)


def attempt_started(proc: subprocess.Popen, started: int) -> bool:
    """Whether torchrun has started a worker group other than those of the pids in `started`."""
    return bool(set(child_pids(proc.pid)) - started) and len(child_pids(proc.pid)) == 2


@pytest.mark.slow
def test_elastic_restarts_mid_save_and_mid_run_equal_uninterrupted(runs, data_dir, tmp_path):
    """One command, `torchrun --max-restarts=2 ... --init_from=auto`, in an empty out_dir: 2-process fsdp
    saving every iteration. Its rank 1 is SIGKILLed inside a save (the temporary directory exists), then,
    after the restart, its rank 0 between saves. torchrun restarts the workers each time, auto resumes them
    from the newest complete sharded checkpoint, and the finished run's losses equal the uninterrupted
    2-process run's bit for bit."""
    out = tmp_path / "killed"
    cfg = dict(parallel="fsdp", activation_checkpointing=True, checkpoint_interval=1, init_from="auto")
    temp = out / checkpointing.SHARDED_TEMP
    newest = out / checkpoint.SHARDED_NAME / checkpoint.META_NAME
    with open(tmp_path / "job.out", "w") as o, open(tmp_path / "job.err", "w") as e:
        job = subprocess.Popen([sys.executable, *TORCHRUN, "--max-restarts=2", "--monitor-interval=0.1", "train.py",
                                *argv(out, data_dir, **cfg)], cwd=REPO_ROOT, stdout=o, stderr=e,
                               env=os.environ | ONE_THREAD_ENV | {"PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: saved_iter(newest.parent) >= 3, job)
        wait_until(temp.exists, job)  # the next save has begun: the processes are writing their shards
        first = set(child_pids(job.pid))
        kill_worker(job, rank=1)
        wait_until(lambda: attempt_started(job, first), job)
        wait_until(lambda: saved_iter(newest.parent) >= 8, job)
        time.sleep(0.05)
        kill_worker(job, rank=0)
        assert job.wait(timeout=240) == 0, (tmp_path / "job.err").read_text()[-3000:]
    finally:
        if job.poll() is None:
            kill_job(job)
    text = (tmp_path / "job.out").read_text()
    assert text.count("resuming from") == 2 and "warning" not in text, text
    assert not temp.exists()
    assert dict(losses(out)) == dict(losses(runs["fsdp2"]))


@pytest.mark.slow
def test_fsdp_state_per_process_is_half_of_ddp_at_two_processes():
    """bench.py's memory figures: after a step, each of 2 fsdp processes holds half the parameter, gradient
    and AdamW bytes of one full copy (what ddp keeps on every process)."""
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    full = bench_memory.spawned_state_bytes("ddp", 1, config, batch_size=2)[0]
    # AdamW: two moments like the weights, and a float32 scalar step per parameter tensor
    assert full["params"] > 0 and full["optimizer"] == 2 * full["params"] + 4 * len(list(GPT(config).parameters()))
    for rank in bench_memory.spawned_state_bytes("fsdp", 2, config, batch_size=2):
        for key in ("params", "grads"):
            assert rank[key] == pytest.approx(full[key] / 2, rel=0.02), (key, rank, full)
        assert rank["optimizer"] == pytest.approx(full["optimizer"] / 2, rel=0.05), (rank, full)


def test_activation_checkpointing_same_losses_less_activation_memory(tmp_path):
    """Checkpointing each Block gives the same loss and gradients, and the forward + backward's peak
    memory (torch's CPU allocator events, as bench.py measures) is under half of the plain one's."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=128, vocab_size=64, n_layer=6, n_head=4, n_embd=64)
    plain = GPT(config)
    with torch.no_grad():  # sharper attention than the 0.02 init, so a wrong recompute would show
        for block in plain.transformer.h:
            block.attn.c_attn.weight.mul_(8)
    ckpt = GPT(config)
    ckpt.load_state_dict(plain.state_dict())
    parallel.apply_activation_checkpointing(ckpt)
    assert ckpt.state_dict().keys() == plain.state_dict().keys()  # checkpoints keep GPT's names
    x = torch.randint(0, 64, (8, 128), generator=torch.Generator().manual_seed(1))

    def step(model):
        return lambda: model(x, x)[1].backward()

    peaks = common.cpu_peak_extra_bytes({"plain": step(plain), "checkpointed": step(ckpt)})
    assert peaks["checkpointed"] < 0.5 * peaks["plain"], peaks
    assert torch.equal(plain(x, x)[1], ckpt(x, x)[1])
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)

    data = tmp_path / "data"
    make_char_dataset(data, TEXT)
    train_tiny(tmp_path / "plain", data, n_layer=2)
    train_tiny(tmp_path / "ckpt", data, n_layer=2, activation_checkpointing=True)
    assert dict(losses(tmp_path / "plain")) == dict(losses(tmp_path / "ckpt"))


# --- sharded checkpoint files (one process, in-process) -----------------------------------------

@pytest.fixture
def sharded_out(tmp_path, data_dir):
    """out_dir of a tiny 1-process fsdp run that saved at iterations 10 and 20."""
    train_tiny(tmp_path / "out", data_dir, parallel="fsdp", checkpoint_interval=10)
    return tmp_path / "out"


def rewrite(path: Path, name: str, data: bytes) -> None:
    """Replace one file of a sharded checkpoint and update its CRC-32 in meta.json, as an attacker could."""
    (path / name).write_bytes(data)
    record = json.loads((path / checkpoint.META_NAME).read_text())
    record["files"][name] = zlib.crc32(data)
    (path / checkpoint.META_NAME).write_text(json.dumps(record))


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_sharded_checkpoint_never_unpickles_arbitrary_objects(sharded_out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = sharded_out / checkpoint.SHARDED_NAME
    assert checkpoint.load_checkpoint(path)["meta"]["iter_num"] == 20  # intact, it loads
    rewrite(path, ".metadata", pickle.dumps(_Payload()))
    with pytest.raises(UserError, match="never loaded"):
        checkpoint.load_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()
    # a non-tensor value (what DCP stores for the optimizer's hyperparameters) is read weights_only
    buf = io.BytesIO()
    torch.save(_Payload(), buf)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint._safe_reader_and_planner()[1]().load_bytes(None, io.BytesIO(buf.getvalue()))
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("damage", ["bit flipped", "shard missing"])
def test_damaged_sharded_checkpoint_falls_back_to_the_previous_one(sharded_out, damage):
    """A flipped bit in a shard, or a shard file gone (also from meta.json's list): one clear error, and
    resume falls back to ckpt.prev.dcp."""
    path = sharded_out / checkpoint.SHARDED_NAME
    shard = path / "__0_0.distcp"
    if damage == "bit flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
        record = json.loads((path / checkpoint.META_NAME).read_text())
        del record["files"][shard.name]
        (path / checkpoint.META_NAME).write_text(json.dumps(record))
    with pytest.raises(UserError, match="CRC-32" if damage == "bit flipped" else "incomplete .no __0_0.distcp"):
        checkpoint.load_checkpoint(path)
    logged = []
    state, used = checkpoint.load_latest(sharded_out, log=logged.append, sharded=True)
    assert used.name == checkpoint.PREV_SHARDED_NAME and state["meta"]["iter_num"] == 10 and "warning" in logged[0]
    assert state["model"] is None  # the weights load after sharding


def test_kill_between_the_two_renames_leaves_the_previous_checkpoint(sharded_out, monkeypatch):
    """The save's last step renames ckpt.dcp to ckpt.prev.dcp, then the new one to ckpt.dcp; dying in
    between leaves no ckpt.dcp, and resume uses ckpt.prev.dcp, the newest complete one."""
    model = GPT(GPTConfig(**read_json_meta(sharded_out / checkpoint.SHARDED_NAME)["model_args"]))
    optimizer = torch.optim.AdamW(model.parameters())
    real_replace, calls = os.replace, []

    def dies_on_second(src, dst):  # of the directory renames (meta.json is written through one too)
        if Path(src).is_dir():
            calls.append(dst)
        if len(calls) == 2 and Path(src).is_dir():
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(checkpointing.os, "replace", dies_on_second)
    with pytest.raises(OSError):
        checkpointing.save_sharded(sharded_out, {"iter_num": 99}, model, optimizer)
    assert not (sharded_out / checkpoint.SHARDED_NAME).exists()
    state, used = checkpoint.load_latest(sharded_out, log=lambda *a: None, sharded=True)
    assert used.name == checkpoint.PREV_SHARDED_NAME and state["meta"]["iter_num"] == 20


def test_disk_full_during_a_sharded_save_keeps_the_checkpoints(sharded_out, data_dir, monkeypatch):
    """A shard write that fails (here: no space left) stops the run with one line; ckpt.dcp is untouched."""
    import train

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    before = {p.name: p.read_bytes() for p in (sharded_out / checkpoint.SHARDED_NAME).iterdir()}
    argv = cli_args(TINY_TRAIN, out_dir=sharded_out, data_dir=data_dir)
    result = run_main(train.main, [*argv, "--parallel=fsdp", "--init_from=resume", "--max_iters=22"])
    assert_user_error(result, f"no space left to write {sharded_out / checkpoint.SHARDED_NAME} (No space left on "
                      f"device", "it needs about", f"the last intact checkpoint, {sharded_out / checkpoint.SHARDED_NAME} "
                      f"(iter 20), is untouched")
    assert {p.name: p.read_bytes() for p in (sharded_out / checkpoint.SHARDED_NAME).iterdir()} == before
    assert not (sharded_out / checkpointing.SHARDED_TEMP).exists()  # the partial shards removed


def test_a_failed_shard_write_names_its_cause_and_keeps_the_checkpoints(sharded_out, monkeypatch):
    """A shard write that fails for another reason than space is an OSError naming the writer's own error."""
    model = GPT(GPTConfig(**read_json_meta(sharded_out / checkpoint.SHARDED_NAME)["model_args"]))

    def denied(*args, **kwargs):
        raise PermissionError("shard write denied")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", denied)
    with pytest.raises(OSError, match=r"writing the shards failed \(.*shard write denied"):
        checkpointing.save_sharded(sharded_out, {"iter_num": 99}, model, torch.optim.AdamW(model.parameters()))
    assert not (sharded_out / checkpointing.SHARDED_TEMP).exists()
    assert read_json_meta(sharded_out / checkpoint.SHARDED_NAME)["iter_num"] == 20


def test_parallel_mistakes_are_one_line(sharded_out, data_dir):
    """An unknown parallel, float16 with fsdp, and resuming with the other parallel's checkpoint format."""
    import train

    common = cli_args(TINY_TRAIN, out_dir=sharded_out, data_dir=data_dir)
    assert_user_error(run_main(train.main, [*common, "--parallel=zero"]), "parallel must be 'ddp' or 'fsdp'")
    assert_user_error(run_main(train.main, [*common, "--parallel=fsdp", "--dtype=float16"]), "not float16")
    # --parallel given (without it, resume takes the run's own fsdp from config.json)
    assert_user_error(run_main(train.main, [*common, "--init_from=resume", "--parallel=ddp"]),
                      "resume it with --parallel=fsdp")
