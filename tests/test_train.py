"""train.py: learning, the LR schedule, exact resume, its outputs and options (DDP: tests/test_ddp.py).

    python -m pytest tests/test_train.py
"""
import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys

import pytest
import torch

import train
from core.data.tokenizer import CharTokenizer
from core.data.writer import write_dataset
from core.errors import UserError
from core.training import loop
from core.weights.checkpoint import load_checkpoint
import model as modellib
from tests.helpers import (REPO_ROOT, TIMINGS, TINY_TRAIN, assert_user_error, char_data_fixture, cli_args, losses,
                           make_chat_dataset, records, run_main, spy_optimizer_steps, train_tiny)

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60


data_dir = char_data_fixture(TEXT)


def de_bruijn(alphabet: str, n: int) -> str:
    """The shortest cyclic string holding every n-letter word over alphabet exactly once."""
    k, a, seq = len(alphabet), [0] * len(alphabet) * n, []

    def db(t, p):
        if t > n:
            if n % p == 0:
                seq.extend(a[1:p + 1])
            return
        a[t] = a[t - p]
        db(t + 1, p)
        for j in range(a[t - p] + 1, k):
            a[t] = j
            db(t + 1, t)

    db(1, 1)
    return "".join(alphabet[i] for i in seq)


@pytest.fixture(scope="module")
def context_data_dir(tmp_path_factory):
    """A text only context can predict: "aabacadbbcbdccdd" repeated. Each letter is followed by each of
    the four equally often, so a model of the current token alone (bigram, or no attention) cannot get
    below log 4 = 1.386 nats; each pair of letters occurs once per period, so two tokens of context
    predict the next exactly."""
    d = tmp_path_factory.mktemp("context")
    assert de_bruijn("abcd", 2) == "aabacadbbcbdccdd"
    text = de_bruijn("abcd", 2) * 200
    tok = CharTokenizer(list("abcd"))  # the four letters only: no <|endoftext|> class to learn away in 60 steps
    n = int(len(text) * 0.9)
    write_dataset(d, tok.meta(), {"train": tok.encode(text[:n]), "val": tok.encode(text[n:])})
    return d


CONTEXT_RUN = dict(max_iters=60, lr_decay_iters=60, log_interval=1, eval_interval=30, eval_iters=4)


def test_loss_decreases_below_what_no_context_allows(tmp_path, context_data_dir):
    train_tiny(tmp_path, context_data_dir, **CONTEXT_RUN)
    trace = losses(tmp_path)
    assert [it for it, _ in trace] == list(range(60))
    first, last = sum(l for _, l in trace[:5]) / 5, sum(l for _, l in trace[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    evals = [r for r in records(tmp_path) if "val_loss" in r]
    assert [e["iter"] for e in evals] == [0, 30, 60]
    assert evals[-1]["val_loss"] < 0.75 * math.log(4), evals  # 0.87 measured: it uses the context


def test_without_attention_the_same_run_cannot_pass(tmp_path, context_data_dir, monkeypatch):
    """The control for the test above: the data really needs context."""
    import model

    monkeypatch.setattr(model.CausalSelfAttention, "forward", lambda self, x, *args, **kwargs: torch.zeros_like(x))
    train_tiny(tmp_path, context_data_dir, **CONTEXT_RUN)
    final = [r for r in records(tmp_path) if "val_loss" in r][-1]
    assert final["val_loss"] > 0.95 * math.log(4), final


def test_outputs_config_log_and_checkpoint(tmp_path, data_dir):
    ckpt_path = train_tiny(tmp_path, data_dir, max_iters=4, log_interval=2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_iters"] == 4 and config["world_size"] == 1 and config["dtype"] == "float32"
    state = load_checkpoint(ckpt_path)
    meta = state["meta"]
    assert meta["iter_num"] == 4 and meta["tokenizer"]["tokenizer"] == "char"
    assert meta["model_args"]["n_embd"] == TINY_TRAIN["n_embd"]
    assert set(state) == {"format", "meta", "model", "optimizer", "scaler", "rng"}
    record = records(tmp_path)[1]
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


def test_min_lr_matters_only_with_decay():
    with pytest.raises(UserError, match="min_lr"):
        train.TrainConfig(learning_rate=1e-4, min_lr=1e-3).validate()
    train.TrainConfig(learning_rate=1e-4, min_lr=1e-3, decay_lr=False).validate()  # finetune_shakespeare.py's case


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, data_dir):
    """A chat dataset in the text's characters, and a base run on the text to fine-tune from."""
    tmp = tmp_path_factory.mktemp("chat")
    train_tiny(tmp / "base", data_dir, max_iters=4, lr_decay_iters=4)
    rng = random.Random(0)
    words = TEXT.split()
    convs = [[{"role": "user", "content": " ".join(rng.sample(words, 3))},
              {"role": "assistant", "content": " ".join(rng.sample(words, rng.randint(1, 4)))}] for _ in range(60)]
    make_chat_dataset(tmp / "data", convs, tokenizer_from=tmp / "base", block_size=32)
    return tmp / "data", tmp / "base"


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_exact_resume_and_the_log_trimmed_to_the_checkpoint(tmp_path, data_dir, chat_run, kind):
    """Stopped after a checkpoint and resumed, a run's per-iteration losses equal the uninterrupted
    run's exactly, dropout included (its RNG state is in the checkpoint). Resumed from an older
    checkpoint than its log reached (as after a kill), the iterations logged past it are dropped and
    redone: log.jsonl then reads exactly as the uninterrupted run's, no iteration twice. The same for a
    chat fine-tune (masked loss, rows from conversation starts) started from a base run's weights."""
    common = dict(max_iters=16, lr_decay_iters=16, warmup_iters=4, log_interval=1, eval_interval=8, dropout=0.1)
    if kind == "chat":
        data_dir, base = chat_run
        common["init_from"] = str(base)
    train_tiny(tmp_path / "a", data_dir, **common)
    train_tiny(tmp_path / "b", data_dir, **(common | {"max_iters": 8}))
    shutil.copy(tmp_path / "b" / "ckpt.pt", tmp_path / "ckpt8.pt")
    train_tiny(tmp_path / "b", data_dir, **(common | {"max_iters": 12, "init_from": "resume"}))
    assert [it for it, _ in losses(tmp_path / "b")] == list(range(12))
    shutil.copy(tmp_path / "ckpt8.pt", tmp_path / "b" / "ckpt.pt")  # iterations 8-11 were logged, never saved
    train_tiny(tmp_path / "b", data_dir, **(common | {"init_from": "resume"}))
    assert [r["iter"] for r in records(tmp_path / "a")] == [0, *range(8), 8, *range(8, 16), 16]  # evals at 0, 8, 16
    timeless = [[{k: v for k, v in r.items() if k not in TIMINGS} for r in records(tmp_path / run)] for run in "ab"]
    assert timeless[1] == timeless[0]  # losses, lrs and evals bit for bit, in order
    sa, sb = load_checkpoint(tmp_path / "a" / "ckpt.pt"), load_checkpoint(tmp_path / "b" / "ckpt.pt")
    for name, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][name]), name


def records_untimed(logged: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in logged]


def test_eval_only_evaluates_once_and_writes_no_checkpoint(tmp_path, data_dir):
    train_tiny(tmp_path, data_dir, max_iters=8, lr_decay_iters=8, eval_interval=8)
    trained = records(tmp_path)
    saved = (tmp_path / "ckpt.pt").read_bytes()
    result = run_main(train.main, cli_args(
        TINY_TRAIN, out_dir=tmp_path, data_dir=data_dir, init_from="resume", eval_only=True, max_iters=8,
        lr_decay_iters=8, eval_interval=8))
    assert result.returncode == 0, result.stderr
    assert "step 8: train loss" in result.stdout and "\niter " not in result.stdout and "saved" not in result.stdout
    assert records(tmp_path, timings=False) == records_untimed(trained)  # the eval at 8 again: the same numbers
    assert (tmp_path / "ckpt.pt").read_bytes() == saved and not (tmp_path / "ckpt.prev.pt").exists()
    train_tiny(tmp_path / "scratch", data_dir, eval_only=True)
    assert [set(r) for r in records(tmp_path / "scratch")] == [{"iter", "train_loss", "val_loss", "lr", "time",
                                                                 "elapsed_s"}]
    assert not (tmp_path / "scratch" / "ckpt.pt").exists()


@pytest.mark.parametrize("always", [True, False])
def test_always_save_checkpoint(tmp_path, data_dir, monkeypatch, always):
    """Scripted val losses at evals 0, 2, 4, 6, 8: False saves only where val improves (2 and 6), True at
    every eval after the first; both save at the end (9)."""
    vals = iter([5.0, 4.0, 4.5, 3.9, 4.2])
    monkeypatch.setattr(train, "estimate_loss", lambda *args: {"train": 1.0, "val": next(vals)})
    saved = []
    real_save = train.checkpointing.save_checkpoint

    def recording_save(out_dir, meta, *args):
        saved.append((meta["iter_num"], meta["best_val_loss"]))
        return real_save(out_dir, meta, *args)

    monkeypatch.setattr(train.checkpointing, "save_checkpoint", recording_save)
    train_tiny(tmp_path, data_dir, max_iters=9, eval_interval=2, always_save_checkpoint=always)
    expected = [(2, 4.0), (4, 4.0), (6, 3.9), (8, 3.9), (9, 3.9)] if always else [(2, 4.0), (6, 3.9), (9, 3.9)]
    assert saved == expected


def test_gradient_clipping_clips_to_grad_clip(tmp_path, data_dir, monkeypatch):
    """One step of train.py after a huge loss (x 1e4): the optimizer sees gradients of total norm exactly
    grad_clip; with grad_clip=0 it sees them as they are; after the step they are zeroed."""
    forward = modellib.GPT.forward

    def huge_loss(self, *args, **kwargs):
        logits, loss = forward(self, *args, **kwargs)
        return logits, loss * 1e4 if self.training else loss
    monkeypatch.setattr(modellib.GPT, "forward", huge_loss)

    def grad_norm_seen_by_the_optimizer(grad_clip: float) -> float:
        seen, step = [], torch.optim.AdamW.step

        def spy(self, *args, **kwargs):
            seen.append(torch.nn.utils.get_total_norm([p.grad for g in self.param_groups for p in g["params"]]).item())
            return step(self, *args, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(torch.optim.AdamW, "step", spy)
            steps = spy_optimizer_steps(m)
            train_tiny(tmp_path / str(grad_clip), data_dir, max_iters=1, grad_clip=grad_clip)
        assert len(seen) == 1 and all(p.grad is None for g in steps[0].param_groups for p in g["params"])
        return seen[0]

    assert grad_norm_seen_by_the_optimizer(0.5) == pytest.approx(0.5, rel=1e-5)
    assert grad_norm_seen_by_the_optimizer(0.0) > 100


def test_help_lists_every_key_and_does_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_main(train.main, ["--help"])
    assert result.returncode == 0 and result.stderr == ""
    for field in dataclasses.fields(train.TrainConfig):
        assert f"  --{field.name}={field.default!r}  (" in result.stdout, field.name
    assert list(tmp_path.iterdir()) == []  # no out_dir, nothing written


def test_nonfinite_weights_are_never_saved(tmp_path, data_dir, monkeypatch):
    """Weights turned NaN in the last step (its loss was finite): the save at the end refuses with one
    line, and ckpt.pt stays the last good checkpoint (iter 4)."""
    def corrupt_after_the_8th(optimizer, n):
        if n == 8:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0][0, 0] = float("nan")

    spy_optimizer_steps(monkeypatch, after=corrupt_after_the_8th)
    argv = TINY_TRAIN | dict(out_dir=tmp_path, data_dir=data_dir, max_iters=8, checkpoint_interval=4)
    result = run_main(train.main, cli_args(argv))
    assert_user_error(result, "non-finite weights at iter 8", f"not saving over the last good checkpoint in {tmp_path}")
    state = load_checkpoint(tmp_path / "ckpt.pt")
    assert state["meta"]["iter_num"] == 4 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_reading_a_checkpoint_imports_no_training_code():
    """sample.py, eval.py and serve.py read checkpoints through core/weights: that loads neither the
    optimizers nor the ddp | fsdp code (saving is core/training/checkpointing.py's, train.py's side)."""
    training = ("core.training.optim", "core.training.parallel")
    code = f"import core.weights.checkpoint, core.weights.resolver, sys; print([m for m in {training} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"reading a checkpoint imported {result.stdout.strip()}"


# --- a newcomer's mistakes: another run's checkpoint, resuming, the stop hint -------------------------

def tiny_argv(**cfg) -> list[str]:
    return cli_args(TINY_TRAIN | cfg)


def test_a_new_run_never_replaces_another_runs_checkpoint(tmp_path, data_dir):
    """A scratch run into an out_dir holding a checkpoint stops with one line naming that checkpoint's
    iteration and loss and the ways on, and touches nothing; --overwrite=True replaces it."""
    out = tmp_path / "run"
    train_tiny(out, data_dir, max_iters=4)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    best = load_checkpoint(out / "ckpt.pt")["meta"]["best_val_loss"]
    result = run_main(train.main, tiny_argv(out_dir=str(out), data_dir=str(data_dir), max_iters=2))
    assert_user_error(result, f"{out} already holds", "ckpt.pt at iter 4", f"best val loss {best:.4f}",
                      "--init_from=resume", "--overwrite=True")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    train_tiny(out, data_dir, max_iters=2, overwrite=True)
    assert load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"] == 2


def test_resume_takes_the_runs_own_config(tmp_path, data_dir):
    """`--init_from=resume --out_dir=RUN` alone resumes RUN with its config.json (its data, model and
    schedule): the losses equal an uninterrupted run's; a key given on top applies (max_iters), and one
    the checkpoint cannot take is refused as before."""
    run = dict(max_iters=4, log_interval=1, n_embd=48, dropout=0.1)
    train_tiny(tmp_path / "a", data_dir, **run)
    resumed = run_main(train.main, ["--init_from=resume", f"--out_dir={tmp_path / 'a'}", "--max_iters=8"])
    assert resumed.returncode == 0, resumed.stderr
    train_tiny(tmp_path / "b", data_dir, **(run | dict(max_iters=8)))
    assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "b")) == 8
    assert_user_error(run_main(train.main, ["--init_from=resume", f"--out_dir={tmp_path / 'a'}", "--n_layer=3"]),
                      "n_layer=3 differs from the checkpoint's 1")


@pytest.mark.slow
def test_the_stop_hint_works_when_pasted(tmp_path, data_dir, monkeypatch):
    """SIGTERM after 3 steps (the 4th, under way, is finished): train.py prints a command; run exactly as
    printed (python is this interpreter), it resumes the run and finishes it."""
    import os
    import shlex
    import signal
    import subprocess
    import sys
    from tests.helpers import ONE_THREAD_ENV, REPO_ROOT

    spy_optimizer_steps(monkeypatch, after=lambda opt, n: n == 3 and os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "a run"  # a space: the hint must quote it
    stopped = run_main(train.main, tiny_argv(out_dir=str(out), data_dir=str(data_dir), max_iters=6))
    assert stopped.returncode == 0, stopped.stderr
    hint = stopped.stdout.split("continue with: ", 1)[1].splitlines()[0]
    argv = shlex.split(hint)
    assert argv[0] == "python"
    done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=os.environ | ONE_THREAD_ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resuming from {out / 'ckpt.pt'} at iter 4" in done.stdout  # the step under way was finished
    assert load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"] == 6


def test_a_missing_dataset_names_only_prepare_scripts_that_exist_and_leaves_no_file(tmp_path):
    """--data_dir=data/nope: one line whose suggested prepare scripts all exist; out_dir is never created."""
    import re
    from tests.helpers import REPO_ROOT

    result = run_main(train.main, tiny_argv(out_dir=str(tmp_path / "out"), data_dir="data/nope"))
    assert_user_error(result, "data/nope/meta.json not found", "data/nope has none", "shakespeare_char")
    names = re.search(r"NAME one of ([\w, ]+)\)", result.stderr).group(1).split(", ")
    assert "hellaswag" not in names and all((REPO_ROOT / "data" / n / "prepare.py").is_file() for n in names), names
    assert "data/nope/prepare.py" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_progress_position_eta_total_time_and_timestamped_log(tmp_path, data_dir):
    """Each logged iteration shows iter/max_iters, elapsed and ETA; the end shows the total time and the
    best val loss; every log record has a wall-clock time and elapsed_s, which a resume counts on from."""
    import time

    started = time.time()
    result = run_main(train.main, tiny_argv(out_dir=str(tmp_path), data_dir=str(data_dir), max_iters=8,
                                            eval_interval=4, log_interval=2))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("iter ")]
    assert [line.split(":")[0] for line in lines] == ["iter 1/8", "iter 3/8", "iter 5/8", "iter 7/8"]
    assert all(" | elapsed " in line and ", eta " in line for line in lines), lines
    assert lines[-1].endswith("eta 0s")
    best = load_checkpoint(tmp_path / "ckpt.pt")["meta"]["best_val_loss"]
    end = result.stdout.strip().splitlines()[-1]
    assert end.startswith("done at iter 8/8 after ") and end.endswith(f"best val loss {best:.4f}"), end
    first = records(tmp_path)
    assert all(started - 1 <= r["time"] <= time.time() + 1 for r in first)
    elapsed = [r["elapsed_s"] for r in first]
    assert elapsed == sorted(elapsed) and elapsed[-1] > 0
    train_tiny(tmp_path, data_dir, max_iters=10, eval_interval=4, log_interval=2, init_from="resume")
    resumed = records(tmp_path)[len(first):]
    assert resumed and min(r["elapsed_s"] for r in resumed) >= elapsed[-1]


def test_wandb_log_without_wandb_is_one_line(tmp_path, data_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as where it is not installed
    result = run_main(train.main, tiny_argv(out_dir=str(tmp_path / "out"), data_dir=str(data_dir), wandb_log=True))
    assert_user_error(result, "wandb_log=True needs wandb: pip install wandb")


# --- the sequence-length warm-up (seq_len_warmup_iters) ------------------------------------------


def test_seq_len_warmup_grows_linearly_in_multiples_of_its_start():
    cfg = train.TrainConfig(block_size=64, seq_len_warmup_iters=100, seq_len_warmup_start=16)
    lens = [train.seq_len_at(it, cfg) for it in range(120)]
    assert lens == [16] * 34 + [32] * 33 + [48] * 33 + [64] * 20  # 16 + 48 * it / 100, rounded down to 16s
    odd = train.TrainConfig(block_size=40, seq_len_warmup_iters=10, seq_len_warmup_start=16)
    assert [train.seq_len_at(it, odd) for it in range(12)] == [16] * 7 + [32] * 3 + [40] * 2
    assert train.seq_len_at(0, train.TrainConfig(block_size=64)) == 64  # off by default: block_size throughout


WARMUP_RUN = dict(block_size=32, batch_size=4, gradient_accumulation_steps=2, seq_len_warmup_iters=8,
                  seq_len_warmup_start=8)  # 8 + 24 * it / 8 in multiples of 8: 8 for 3 iterations, 16, 24, then 32


def test_train_py_trains_on_the_warm_ups_windows_in_every_micro_step(tmp_path, data_dir, monkeypatch):
    """The batches the model trains on (evaluation apart) have the schedule's length in each micro-step,
    the read-ahead ones included; evaluation stays at block_size. config.json records the switch."""
    shapes, forward = [], modellib.GPT.forward

    def spy(self, idx, *args, **kwargs):
        if torch.is_grad_enabled():
            shapes.append(tuple(idx.shape))
        return forward(self, idx, *args, **kwargs)
    monkeypatch.setattr(modellib.GPT, "forward", spy)
    train_tiny(tmp_path, data_dir, max_iters=10, lr_decay_iters=10, log_interval=1, **WARMUP_RUN)
    lengths = [8] * 3 + [16] * 3 + [24] * 2 + [32] * 2  # iterations 0-9
    assert shapes == [(4, n) for n in lengths for _ in range(2)]  # two micro-steps each
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["seq_len_warmup_iters"], config["seq_len_warmup_start"]) == (8, 8)
    tok = [r["tok_per_s"] * r["ms"] / 1000 for r in records(tmp_path) if "loss" in r]
    assert tok == pytest.approx([8 * n for n in lengths])  # the iteration's real tokens, not 8 x 32


def test_resume_inside_the_warm_up_equals_the_uninterrupted_run(tmp_path, data_dir):
    common = dict(max_iters=12, lr_decay_iters=12, warmup_iters=2, log_interval=1, eval_interval=6) | WARMUP_RUN
    train_tiny(tmp_path / "a", data_dir, **common)
    train_tiny(tmp_path / "b", data_dir, **(common | {"max_iters": 4}))  # stopped at a length of 16
    train_tiny(tmp_path / "b", data_dir, **(common | {"init_from": "resume"}))
    timeless = [[{k: v for k, v in r.items() if k not in TIMINGS} for r in records(tmp_path / run)] for run in "ab"]
    assert timeless[1] == timeless[0]
    sa, sb = load_checkpoint(tmp_path / "a" / "ckpt.pt"), load_checkpoint(tmp_path / "b" / "ckpt.pt")
    for name, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][name]), name


@pytest.mark.parametrize("args", [["--seq_len_warmup_iters=-1"],
                                  ["--seq_len_warmup_iters=10", "--seq_len_warmup_start=0"],
                                  ["--seq_len_warmup_iters=10", "--seq_len_warmup_start=64", "--block_size=64"],
                                  ["--seq_len_warmup_iters=10", "--seq_len_warmup_start=128", "--block_size=64"]])
def test_bad_seq_len_warmup_is_one_line(args):
    with pytest.raises(UserError, match=r"need seq_len_warmup_iters >= 0, and 1 <= seq_len_warmup_start < "
                                        r"block_size") as e:
        loop.parse_config(train.TrainConfig, args)
    assert "\n" not in str(e.value)


def tensor_reads(monkeypatch, run) -> list[list[str]]:
    """The tensor reads a host makes (item, bool, float, int, tolist: on a GPU each waits for the device) during
    run(), split at each AdamW update: one list per stretch between updates, each read named by its caller."""
    stretches = [[]]
    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        real = getattr(torch.Tensor, name)

        def read(self, *args, _real=real, **kwargs):
            stretches[-1].append(sys._getframe(1).f_code.co_name)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    spy_optimizer_steps(monkeypatch, after=lambda optimizer, n: stretches.append([]))
    run()
    monkeypatch.undo()
    return stretches


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("log_interval", [1, 1000])
def test_the_step_reads_the_device_once_per_iteration(tmp_path, data_dir, monkeypatch, accum, log_interval):
    """Between two updates train.py's loop reads the device once, the non-finite guard's loss, however many
    micro-steps it runs; on a logged iteration the mean loss too, read before the update where the guard waits
    anyway. A read per micro-step (a .item() in the forward, the loader, the loop) would wait on every one."""
    stretches = tensor_reads(monkeypatch, lambda: train_tiny(
        tmp_path, data_dir, max_iters=6, eval_interval=1000, log_interval=log_interval,
        gradient_accumulation_steps=accum, batch_size=8))
    assert len(stretches) == 7  # before the first update (start-up, the eval at 0), 5 between, after the last
    between = ["global_sum", "optimizer_step"] if log_interval == 1 else ["optimizer_step"]
    assert stretches[1:-1] == [between] * 5
    assert "global_sum" not in stretches[-1]  # the last iteration's mean was read before its update too
