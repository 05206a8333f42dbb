"""DDP through torchrun (2 gloo processes on the CPU) on the path config/gpt2_small.py takes: several
micro-steps per rank (no_sync on all but the last), per-rank dropout RNG across a kill and resume,
resume with another process count, and dist_timeout_s ending a job whose peer hangs.

    python -m pytest tests/test_ddp.py
"""
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import train
from core.weights.checkpoint import load_checkpoint
from tests.helpers import (TINY_TRAIN, char_data_fixture, child_pids, cli_args, make_chat_dataset,
                           process_env, records, run_main, train_tiny)
from tests.test_faults import TORCHRUN, last_logged_iter, start_train, stop_job, wait_for

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60
# 8 micro-batches per iteration: 4 per rank under 2 processes.
MULTI_MICRO = dict(gradient_accumulation_steps=8, batch_size=4, max_iters=6, lr_decay_iters=6, log_interval=1,
                   eval_interval=3, eval_iters=4, dist_timeout_s=60.0)


data_dir = char_data_fixture(TEXT)


def run_job(tmp_path, name: str, data_dir, timeout: float = 180, **cfg) -> Path:
    """A 2-process torchrun job to completion; returns its out_dir."""
    out = tmp_path / name
    job = start_train(out, data_dir, name, launcher=TORCHRUN, **cfg)
    try:
        job.wait(timeout=timeout)
    finally:
        stop_job(job)
    assert job.returncode == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
    return out


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, data_dir):
    """Conversations in the text's characters (data/chat/prepare.py with the text dataset's tokenizer)."""
    d = tmp_path_factory.mktemp("chat")
    words = TEXT.split()
    convs = [[{"role": "user", "content": " ".join(words[i:i + 3])},
              {"role": "assistant", "content": " ".join(words[i + 3:i + 3 + i % 4 + 1])}] for i in range(60)]
    make_chat_dataset(d, convs, tokenizer_from=data_dir, block_size=32)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_two_ranks_of_four_micro_steps_match_one_process_of_eight(tmp_path, data_dir, chat_dir, kind):
    """The global batch is 8 micro-batches either way; 2 ranks x 4 accumulate under no_sync() and all-reduce
    once. Train and val losses (every iteration and every eval) agree with one process to float rounding.
    The same on a chat dataset (loss on the assistant's tokens, rows from conversation starts)."""
    data_dir = chat_dir if kind == "chat" else data_dir
    ddp = run_job(tmp_path, "ddp", data_dir, **MULTI_MICRO)
    stdout = (tmp_path / "ddp.out").read_text()
    assert "2 process(es)" in stdout and stdout.count("step 3:") == 1  # rank 0 alone logs and saves
    assert [line.split(" to ")[0] for line in stdout.splitlines() if line.startswith("saved")] == [
        "saved checkpoint at iter 3", "saved checkpoint at iter 6"]
    assert load_checkpoint(ddp / "ckpt.pt")["meta"]["world_size"] == 2
    train_tiny(tmp_path / "single", data_dir, **MULTI_MICRO)
    d, s = records(ddp, timings=False), records(tmp_path / "single", timings=False)
    assert [r["iter"] for r in d] == [r["iter"] for r in s] == [0, 0, 1, 2, 3, 3, 4, 5, 6]
    for rd, rs in zip(d, s):
        assert rd.keys() == rs.keys()
        for key in rd.keys() - {"iter", "lr"}:
            assert rd[key] == pytest.approx(rs[key], abs=1e-6, rel=0), (rd["iter"], key)
    wd, ws = load_checkpoint(ddp / "ckpt.pt")["model"], load_checkpoint(tmp_path / "single" / "ckpt.pt")["model"]
    for name in ws:  # Adam divides by sqrt(v): rounding in a near-zero gradient moves a weight by ~1e-5
        torch.testing.assert_close(wd[name], ws[name], atol=1e-4, rtol=0)


DROPOUT_RUN = dict(gradient_accumulation_steps=4, max_iters=12, lr_decay_iters=12, log_interval=1, eval_interval=6,
                   eval_iters=2, dropout=0.1, checkpoint_interval=2, dist_timeout_s=60.0)


@pytest.mark.slow
def test_two_ranks_with_dropout_killed_and_resumed_equal_the_uninterrupted_run(tmp_path, data_dir):
    """SIGKILL of the whole job (torchrun and both workers, as when a node is lost) after iteration 7,
    then --init_from=resume under torchrun: every rank's dropout RNG comes back from the checkpoint, so
    the losses, evals and weights are the uninterrupted run's bit for bit, and log.jsonl has each
    iteration once. Then the same checkpoint resumed by ONE process: it says what changes and trains on."""
    reference = run_job(tmp_path, "uninterrupted", data_dir, **DROPOUT_RUN)
    out = tmp_path / "killed"
    job = start_train(out, data_dir, "first", launcher=TORCHRUN, **DROPOUT_RUN)
    try:
        assert wait_for(lambda: last_logged_iter(out) >= 7, job, timeout=120), "finished before the kill"
        stop_job(job)  # SIGKILL to torchrun and to each worker
    finally:
        stop_job(job)
    assert job.returncode == -signal.SIGKILL
    killed_at = load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"]
    assert killed_at < DROPOUT_RUN["max_iters"]
    run_job(tmp_path, "killed", data_dir, **DROPOUT_RUN, init_from="resume")
    assert f"at iter {killed_at}" in (tmp_path / "killed.out").read_text()
    assert records(out, timings=False) == records(reference, timings=False)
    final, ref = load_checkpoint(out / "ckpt.pt"), load_checkpoint(reference / "ckpt.pt")
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, final["model"][name]), name

    argv = TINY_TRAIN | DROPOUT_RUN | dict(out_dir=out, data_dir=data_dir, init_from="resume", max_iters=14)
    result = run_main(train.main, cli_args(argv))
    assert result.returncode == 0, result.stderr
    assert "note: the checkpoint was saved by 2 process(es), this run has 1" in result.stdout
    assert "1 process(es)" in result.stdout
    assert [r["iter"] for r in records(out, timings=False) if "loss" in r] == list(range(14))
    assert load_checkpoint(out / "ckpt.pt")["meta"]["world_size"] == 1


def running(pid: int) -> bool:
    """Whether process pid still runs (not exited, nor a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.slow
def test_dist_timeout_ends_a_job_whose_peer_is_stopped(tmp_path, data_dir):
    """A peer that hangs without dying (SIGSTOP: torchrun sees it alive) blocks the next all-reduce; after
    dist_timeout_s rank 0's collective fails with gloo's timeout and rank 0 exits, so torchrun ends the job,
    non-zero, naming rank 0 as the root cause, instead of hanging. (torchrun then gives the stopped worker
    30 s to obey SIGTERM; the test kills it as soon as rank 0 has exited, to keep that wait out.)"""
    timeout_s = 3.0
    out = tmp_path / "ddp"
    job = start_train(out, data_dir, "stopped", launcher=(*TORCHRUN, "--max-restarts=0"),
                      **dict(gradient_accumulation_steps=2, max_iters=10**6, log_interval=1, eval_interval=10**6,
                             dist_timeout_s=timeout_s))
    workers = {}
    try:
        assert wait_for(lambda: last_logged_iter(out) >= 3, job, timeout=120), "the job ended early"
        workers = {int(process_env(pid).get("RANK", -1)): pid for pid in child_pids(job.pid)}
        os.kill(workers[1], signal.SIGSTOP)
        t_stop = time.monotonic()
        wait_for(lambda: not running(workers[0]), job, timeout=timeout_s + 60, poll=0.05)
        took = time.monotonic() - t_stop
        os.kill(workers[1], signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        if 1 in workers:
            try:
                os.kill(workers[1], signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop_job(job)
    stderr = (tmp_path / "stopped.err").read_text()
    assert job.returncode != 0
    assert timeout_s - 0.5 <= took < timeout_s + 30, took  # the timeout ended it: not sooner, and not never
    assert f"Timed out waiting {int(timeout_s * 1000)}ms" in stderr, stderr[-3000:]
    root_cause = stderr[stderr.index("Root Cause"):]
    assert "rank      : 0" in root_cause, root_cause
