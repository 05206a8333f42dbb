"""train.py: learning, the LR schedule, exact resume, DDP through torchrun, and its outputs.

    python -m pytest tests/test_train.py
"""
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

import train
from core.checkpoint import load_checkpoint
from core.errors import UserError
from tests.helpers import ONE_THREAD_ENV, REPO_ROOT, TINY_TRAIN, make_char_dataset, train_tiny

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60


def losses(out_dir) -> dict[int, float]:
    """iter -> training loss from out_dir/log.jsonl."""
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    return {r["iter"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_char_dataset(d, TEXT)
    return d


def test_loss_decreases(tmp_path, data_dir):
    train_tiny(tmp_path, data_dir, max_iters=60, lr_decay_iters=60, log_interval=1, eval_interval=30)
    trace = losses(tmp_path)
    assert len(trace) == 60
    first, last = sum(trace[i] for i in range(5)) / 5, sum(trace[i] for i in range(55, 60)) / 5
    assert last < 0.6 * first, (first, last)
    evals = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [e["iter"] for e in evals] == [0, 30, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_outputs_config_log_and_checkpoint(tmp_path, data_dir):
    ckpt_path = train_tiny(tmp_path, data_dir, max_iters=4, log_interval=2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_iters"] == 4 and config["world_size"] == 1 and config["dtype"] == "float32"
    state = load_checkpoint(ckpt_path)
    meta = state["meta"]
    assert meta["iter_num"] == 4 and meta["tokenizer"]["tokenizer"] == "char"
    assert meta["model_args"]["n_embd"] == TINY_TRAIN["n_embd"]
    assert set(state) == {"format", "meta", "model", "optimizer", "scaler", "rng"}
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[1])
    assert set(record) >= {"iter", "loss", "lr", "ms", "tok_per_s", "mfu"}


def test_lr_schedule_shape():
    cfg = train.TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=100)
    lrs = [train.get_lr(it, cfg) for it in range(120)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))  # warmup rises
    assert lrs[0] > 0 and lrs[10] == pytest.approx(1.0)  # the peak right after warmup
    assert all(a >= b for a, b in zip(lrs[10:100], lrs[11:101]))  # cosine falls
    assert lrs[55] == pytest.approx(0.55)  # halfway down the cosine: the mid point of lr and min_lr
    assert lrs[100:] == [0.1] * 20
    assert train.get_lr(50, train.TrainConfig(decay_lr=False, learning_rate=0.3)) == 0.3


def test_accumulation_must_divide_by_world_size():
    assert train.local_accum_steps(train.TrainConfig(gradient_accumulation_steps=8), 4) == 2
    with pytest.raises(UserError, match=r"gradient_accumulation_steps \(3\) must be divisible .* \(2\)"):
        train.local_accum_steps(train.TrainConfig(gradient_accumulation_steps=3), 2)


def test_exact_resume(tmp_path, data_dir):
    """Stopped after a checkpoint and resumed, a run's per-iteration losses equal the uninterrupted
    run's exactly, dropout included (its RNG state is in the checkpoint)."""
    common = dict(max_iters=16, lr_decay_iters=16, warmup_iters=4, log_interval=1, eval_interval=8, dropout=0.1)
    train_tiny(tmp_path / "a", data_dir, **common)
    train_tiny(tmp_path / "b", data_dir, **(common | {"max_iters": 10}))
    train_tiny(tmp_path / "b", data_dir, **(common | {"init_from": "resume"}))
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == list(range(16))
    assert a == b  # bit for bit
    sa, sb = load_checkpoint(tmp_path / "a" / "ckpt.pt"), load_checkpoint(tmp_path / "b" / "ckpt.pt")
    for name, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][name]), name


@pytest.mark.slow
def test_ddp_two_processes_match_one_with_twice_the_accumulation(tmp_path, data_dir):
    """torchrun with 2 gloo processes (accumulation 1 each) reads the same global batch as one
    process accumulating 2 micro-batches, and saves one checkpoint."""
    args = {k: v for k, v in TINY_TRAIN.items()} | dict(max_iters=6, lr_decay_iters=6, log_interval=1,
                                                          eval_interval=6, gradient_accumulation_steps=2)
    argv = [f"--{k}={v}" for k, v in args.items()]
    ddp_out, single_out = tmp_path / "ddp", tmp_path / "single"
    ddp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *argv,
         f"--out_dir={ddp_out}", f"--data_dir={data_dir}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, **ONE_THREAD_ENV})
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert ddp.stdout.count("saved checkpoint") == 1  # only rank 0 saves and logs
    assert "2 process(es)" in ddp.stdout
    train_tiny(single_out, data_dir, **(args | {"gradient_accumulation_steps": 2}))
    d, s = losses(ddp_out), losses(single_out)
    assert sorted(d) == sorted(s) == list(range(6))
    for it in d:
        assert d[it] == pytest.approx(s[it], abs=1e-5), it
    assert sorted(p.name for p in ddp_out.glob("ckpt*.pt")) == ["ckpt.pt"]
    assert load_checkpoint(ddp_out / "ckpt.pt")["meta"]["world_size"] == 2
