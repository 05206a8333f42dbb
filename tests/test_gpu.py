"""The CUDA path end to end, through the real command lines: the `gpu` tests need a GPU (skipped without one), and
scripts/gpu_check.sh's dry run checks on the CPU that the GPU check runs and reports.

    python -m pytest -m gpu                  # on a CUDA machine; scripts/gpu_check.sh runs it with bench.py
    python -m pytest tests/test_gpu.py -m "not gpu"     # the dry run (a minute or two)

Each gpu test runs `python train.py` / `python sample.py` as a user would, on a small character model:
  - bfloat16 + torch.compile training whose loss falls, MFU against the datasheet peak;
  - exact resume (float32, naive attention, deterministic cuBLAS: bit for bit);
  - sample.py's greedy text with the KV cache equal to the text without it, past the context window;
  - decoding's captured step (a CUDA graph of the fixed-shape step) giving the plain step's greedy tokens;
  - float16 training through the GradScaler, whose state is saved and resumed.
"""
import os
import subprocess

import pytest
import torch

from core import runtime
from core.decoding.decode import generate, inference_model
from core.weights.checkpoint import load_checkpoint
from core.weights.resolver import load_model
from tests.helpers import REPO_ROOT, char_data_fixture, cli_args, losses, make_char_dataset, records, run_script

gpu = pytest.mark.gpu

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 200
GPU_TRAIN = dict(n_layer=2, n_head=4, n_embd=128, block_size=64, batch_size=32, gradient_accumulation_steps=1,
                 max_iters=80, lr_decay_iters=80, warmup_iters=5, learning_rate=3e-3, min_lr=3e-4,
                 eval_interval=40, eval_iters=4, log_interval=1, dropout=0.0, device="cuda")


data_dir = char_data_fixture(TEXT)


def train(out_dir, data_dir, timeout=600, **cfg):
    args = cli_args(GPU_TRAIN | cfg | dict(out_dir=out_dir, data_dir=data_dir))
    result = run_script("train.py", *args, timeout=timeout, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def falls(trace: dict[int, float]) -> bool:
    its = sorted(trace)
    first, last = (sum(trace[i] for i in part) / len(part) for part in (its[:5], its[-5:]))
    return last < 0.6 * first


@gpu
def test_bf16_compiled_training_loss_falls(tmp_path, data_dir):
    result = train(tmp_path, data_dir, dtype="bfloat16", compile=True)
    assert "on cuda:0 in bfloat16" in result.stdout
    assert "MFU against datasheet dense bfloat16" in result.stdout or "MFU not reported" in result.stdout
    assert falls(dict(losses(tmp_path))), dict(losses(tmp_path))
    state = load_checkpoint(tmp_path / "ckpt.pt")
    assert not [k for k in state["model"] if "_orig_mod" in k]
    mfus = [r["mfu"] for r in records(tmp_path) if r.get("mfu") is not None]
    assert all(0 < m < 1 for m in mfus)


@gpu
def test_exact_resume_on_the_gpu(tmp_path, data_dir):
    common = dict(dtype="float32", attn_backend="naive", compile=False, dropout=0.1, max_iters=16, lr_decay_iters=16,
                  eval_interval=8)
    train(tmp_path / "a", data_dir, **common)
    train(tmp_path / "b", data_dir, **(common | dict(max_iters=10)))
    train(tmp_path / "b", data_dir, **(common | dict(init_from="resume")))
    a, b = dict(losses(tmp_path / "a")), dict(losses(tmp_path / "b"))
    assert sorted(b) == list(range(16)) and a == b


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sample_cache_equals_no_cache_greedy(tmp_path, data_dir, dtype):
    train(tmp_path, data_dir, dtype="bfloat16", compile=False, max_iters=150, lr_decay_iters=150, eval_interval=150)
    runs = {use_cache: run_script("sample.py", f"--out_dir={tmp_path}", "--device=cuda", f"--dtype={dtype}",
                                  "--start=First", "--temperature=0", "--num_samples=3", "--max_new_tokens=200",
                                  f"--use_cache={use_cache}", timeout=300)
            for use_cache in (True, False)}
    for use_cache, r in runs.items():
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"cuda:0 {dtype}" in r.stderr
    assert runs[True].stdout == runs[False].stdout
    assert "Citizen" in runs[True].stdout  # the trained text, not one repeated character


@gpu
def test_fp16_grad_scaler_training_and_resume(tmp_path, data_dir):
    train(tmp_path, data_dir, dtype="float16", compile=False, max_iters=40, lr_decay_iters=60, eval_interval=40)
    assert falls(dict(losses(tmp_path)))
    first = load_checkpoint(tmp_path / "ckpt.pt")["scaler"]
    assert first["scale"] > 0 and first["_growth_tracker"] >= 0
    train(tmp_path, data_dir, dtype="float16", compile=False, max_iters=50, lr_decay_iters=60, eval_interval=40,
          init_from="resume")
    second = load_checkpoint(tmp_path / "ckpt.pt")["scaler"]
    # growth_interval is 2000 steps: without an overflow the tracker counts on from the saved one
    assert second["scale"] < first["scale"] or second["_growth_tracker"] == first["_growth_tracker"] + 10
    assert all(torch.isfinite(torch.tensor(v)) for v in dict(losses(tmp_path)).values())


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_captured_step_gives_the_plain_steps_greedy_tokens(tmp_path, data_dir, dtype):
    """inference_model on CUDA decodes one token at a time through a CUDA graph of the fixed-shape step
    (decode.FixedSteps): 300 greedy tokens past the 64-token context, at batch 1 and 4, equal the plain KV cache's;
    after the first generate of a batch size nothing is compiled again (set_stance fails on a recompile)."""
    train(tmp_path, data_dir, dtype="bfloat16", compile=False, max_iters=150, lr_decay_iters=150, eval_interval=150)
    model, tok, _ = load_model("resume", str(tmp_path))
    model, steps = inference_model(model, runtime.Runtime("cuda:0", "cuda", dtype))
    assert steps is not None
    for batch in (1, 4):
        idx = torch.tensor([tok.encode("First Citizen:"[i:] + "Before"[:i]) for i in range(batch)], device="cuda")
        generate(model, idx, 2, temperature=0.0, steps=steps)  # builds and captures it
        with torch.compiler.set_stance("fail_on_recompile"):
            captured = generate(model, idx, 300, temperature=0.0, steps=steps)
        plain = generate(model, idx, 300, temperature=0.0)
        assert torch.equal(captured, plain)
        assert "Citizen" in tok.decode(plain[0].tolist())


@pytest.mark.slow
def test_the_gpu_checks_dry_run_runs_every_step_and_reports(tmp_path):
    """scripts/gpu_check.sh --cpu-dry-run: every step at tiny sizes on the CPU (train.py with gpt2_small.py's
    config, its resume and torchrun, the sweep, the decode steps, pytest -m gpu), and summary.md with train.py's
    own figures read back from its log (the loss falling, MFU), the sweep's rows and decoding's."""
    make_char_dataset(tmp_path / "data", TEXT)
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out"), "--cpu-dry-run"], cwd=REPO_ROOT,
                          env=os.environ | {"GPU_DATA": str(tmp_path / "data")}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    for name in ("train", "resume", "torchrun", "sweep", "decode", "pytest"):
        assert f"| {name} | 0 |" in summary, summary
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in summary.splitlines() if line.startswith("|")}
    for run, iters in (("train", "0-11"), ("resumed", "12-15"), ("torchrun, 1 process", "0-7")):
        first, last = map(float, rows[run][1].split("->"))
        assert rows[run][0].strip() == iters and last < first, summary
    assert rows["train"][3].strip().endswith("%") and rows["torchrun, 1 process"][3].strip().endswith("%")
    assert "| 1 | eager |" in summary and "| 2 | eager |" in summary  # the sweep's micro-batches
    assert summary.count("| float32 | 1 |") == 1 and summary.count("| float32 | 4 |") == 1


def test_the_gpu_check_without_its_data_is_one_line(tmp_path):
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out"), "--cpu-dry-run"], cwd=REPO_ROOT,
                          env=os.environ | {"GPU_DATA": str(tmp_path / "absent")}, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "no " + str(tmp_path / "absent") + "/train.bin: make it" in done.stderr
