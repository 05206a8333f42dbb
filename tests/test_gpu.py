"""The CUDA path end to end, through the real command lines: needs a GPU (skipped without one).

    python -m pytest -m gpu                  # on a CUDA machine; scripts/gpu_check.sh runs it with bench.py

Each test runs `python train.py` / `python sample.py` as a user would, on a small character model:
  - bfloat16 + torch.compile training whose loss falls, MFU against the datasheet peak;
  - exact resume (float32, naive attention, deterministic cuBLAS: bit for bit);
  - sample.py's greedy text with the KV cache equal to the text without it, past the context window;
  - float16 training through the GradScaler, whose state is saved and resumed.
"""

import pytest
import torch

from core.weights.checkpoint import load_checkpoint
from tests.helpers import char_data_fixture, cli_args, losses, records, run_script

pytestmark = pytest.mark.gpu

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


def test_bf16_compiled_training_loss_falls(tmp_path, data_dir):
    result = train(tmp_path, data_dir, dtype="bfloat16", compile=True)
    assert "on cuda:0 in bfloat16" in result.stdout
    assert "MFU against datasheet dense bfloat16" in result.stdout or "MFU not reported" in result.stdout
    assert falls(dict(losses(tmp_path))), dict(losses(tmp_path))
    state = load_checkpoint(tmp_path / "ckpt.pt")
    assert not [k for k in state["model"] if "_orig_mod" in k]
    mfus = [r["mfu"] for r in records(tmp_path) if r.get("mfu") is not None]
    assert all(0 < m < 1 for m in mfus)


def test_exact_resume_on_the_gpu(tmp_path, data_dir):
    common = dict(dtype="float32", attn_backend="naive", compile=False, dropout=0.1, max_iters=16, lr_decay_iters=16,
                  eval_interval=8)
    train(tmp_path / "a", data_dir, **common)
    train(tmp_path / "b", data_dir, **(common | dict(max_iters=10)))
    train(tmp_path / "b", data_dir, **(common | dict(init_from="resume")))
    a, b = dict(losses(tmp_path / "a")), dict(losses(tmp_path / "b"))
    assert sorted(b) == list(range(16)) and a == b


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
