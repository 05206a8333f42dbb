"""Fault injection: kills, signals, damaged checkpoints, a non-finite loss, a full disk, a dead rank.

    python -m pytest tests/test_faults.py              # ~1.5 min on two busy CPU cores
    python -m pytest tests/test_faults.py -m "not slow"   # the in-process ones, a few seconds

Every run is a tiny float32 model on the CPU. Kills and signals hit real `python train.py` (and
`torchrun`) subprocesses; faults that need a precise moment (a NaN at iteration k, a disk that fills
during the second save) are injected in-process by monkeypatching, and run through core.errors.run_cli
exactly as the command line does. The guarantee under test is always the same: a run either continues
exactly as if nothing had happened, or stops with one clear line, and the last good checkpoint is intact.
"""
import errno
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import model as modellib
import train
from core.errors import UserError
from core.training import checkpointing, loop, runlog
from core.weights.checkpoint import load_checkpoint
from tests.helpers import (ONE_THREAD_ENV, REPO_ROOT, TINY_TRAIN, assert_user_error, char_data_fixture, child_pids,
                           cli_args, flip_a_weight_bit, losses, make_char_dataset, needs_transformers, process_env, run_main, run_script,
                           spy_optimizer_steps, train_tiny)

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60


def train_argv(**cfg) -> list[str]:
    return cli_args(TINY_TRAIN | cfg)


def start_train(out_dir, data_dir, log_name: str, launcher=(), hangup=signal.SIG_DFL, **cfg) -> subprocess.Popen:
    """`python [launcher] train.py --key=value ...` in the background; stdout and stderr go to
    out_dir/../<log_name>.out|.err (files, not pipes: a killed run's output is kept, and a full pipe
    can never block it). hangup: SIGHUP's disposition it starts with, SIG_DFL as from a terminal whatever this
    process has (a suite run under nohup ignores it), SIG_IGN as under nohup."""
    logs = Path(out_dir).parent
    argv = train_argv(out_dir=out_dir, data_dir=data_dir, **cfg)
    with open(logs / f"{log_name}.out", "w") as out, open(logs / f"{log_name}.err", "w") as err:
        return subprocess.Popen([sys.executable, *launcher, "train.py", *argv], cwd=REPO_ROOT, stdout=out, stderr=err,
                                env=os.environ | ONE_THREAD_ENV, preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))


# A process that hangs uses no CPU, so the CPU-time bounds below cannot catch it: this wall-time bound
# does. With two copies of the suite side by side on 2 cores (load average ~25), starting train.py
# alone took over 120 s of wall time; this is several times that.
HANG_S = 900.0


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by pid and its live descendants (torchrun's workers), read
    from /proc; None where there is no /proc (then the bounds fall back to wall time)."""
    if not Path("/proc/self/stat").exists():
        return None
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3, the state
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime: fields 14 and 15
            todo += [int(c) for task in Path(f"/proc/{p}/task").iterdir() for c in (task / "children").read_text().split()]
        except OSError:  # it exited meanwhile
            continue
    return total


class Budget:
    """`seconds` of the processes' own CPU time (wall time where there is no /proc), and HANG_S of wall
    time: a bound that load from other processes does not use up, as it does a wall-time one."""

    def __init__(self, seconds: float, *pids: int):
        self.seconds, self.pids, self.wall_end = seconds, pids, time.monotonic() + HANG_S
        self.start, self.wall_start = self.used(), time.monotonic()

    def used(self) -> float | None:
        cpu = [cpu_seconds(pid) for pid in self.pids]
        return None if None in cpu else sum(cpu)

    def spent(self) -> bool:
        if time.monotonic() > self.wall_end:
            return True
        used = self.used()
        return (time.monotonic() - self.wall_start if used is None else used - self.start) > self.seconds


def wait_for(condition, proc: subprocess.Popen, timeout: float, poll: float = 0.002) -> bool:
    """Poll `condition()` until it holds (True) or `proc` exits (False); once `proc` has used `timeout`
    CPU seconds (or HANG_S wall seconds have passed: see Budget), fail the test."""
    budget, checked = Budget(timeout, proc.pid), time.monotonic()
    while True:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        if time.monotonic() - checked > 0.1:  # reading /proc costs more than a poll
            checked = time.monotonic()
            if budget.spent():
                raise AssertionError(f"timed out after {timeout} CPU s waiting for {condition.__doc__ or condition}")
        time.sleep(poll)


def logged_iters(out_dir) -> int:
    """How many training iterations out_dir/log.jsonl holds (0 while it does not exist)."""
    try:
        return sum('"loss"' in line for line in (Path(out_dir) / "log.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def temp_files(out_dir, pid: int | None = None, prefix: str = ".") -> list[str]:
    """The atomic-write temporaries in out_dir: of process `pid` only and names starting with
    `prefix` (".ckpt": checkpoints), if given."""
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(prefix) and ".tmp-" in n and (pid is None or n.endswith(f".tmp-{pid}"))]


data_dir = char_data_fixture(TEXT)


# --- SIGKILL -----------------------------------------------------------------------------------

# Two layers of width 128 on 2 x 16 tokens: each step is quick and each save writes ~5 MB (weights
# plus AdamW's two moments), so saving is most of an iteration and random kills often land in one.
KILL_RUN = dict(n_layer=2, n_head=4, n_embd=128, block_size=16, batch_size=2, dropout=0.1, max_iters=30,
                lr_decay_iters=30, warmup_iters=4, log_interval=1, eval_interval=1000, eval_iters=1)


def log_records(out_dir) -> list[dict]:
    """out_dir/log.jsonl's whole records (a line being written is left out)."""
    out = []
    for line in (Path(out_dir) / "log.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def last_logged_iter(out_dir) -> int:
    try:
        return max((it for it, _ in losses(out_dir)), default=-1)
    except (FileNotFoundError, json.JSONDecodeError):  # not there yet, or a line being written
        return -1


def wait_stopped(pid: int) -> None:
    """Until SIGSTOP has taken hold of `pid` (its /proc state is T): kill() returns before it has."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().rpartition(")")[2].split()[0] not in "tT" and time.monotonic() < deadline:
        time.sleep(0.0002)


def kill_at_a_random_moment(proc: subprocess.Popen, out_dir: Path, in_write: bool, rng: random.Random) -> bool:
    """SIGKILL `proc` a random 2-6 iterations into its training (counted in iterations, not seconds, so
    that a faster machine does not finish first): then at once, inside its next checkpoint write
    (in_write: frozen with SIGSTOP while its temporary file exists, so the kill lands mid-write), or
    after up to 50 ms more. Returns whether it was killed (not already finished)."""
    def saving() -> bool:
        """proc writing a checkpoint"""
        return bool(temp_files(out_dir, proc.pid, prefix=".ckpt"))

    # Its first save: training has started, and log.jsonl holds this run's records, not a killed one's.
    if not wait_for(saving, proc, timeout=60):
        return False
    target = last_logged_iter(out_dir) + rng.randint(2, 6)

    def reached() -> bool:
        """the random target iteration"""
        return last_logged_iter(out_dir) >= target

    if not wait_for(reached, proc, timeout=60, poll=0.005):
        return False
    if in_write:
        # Seen mid-write, the write may still finish before a SIGKILL lands (on a loaded machine it often
        # does): freeze the process first, and kill it only if the temporary is still there.
        for _ in range(100):
            if not wait_for(saving, proc, timeout=10, poll=0.0005):
                return False
            proc.send_signal(signal.SIGSTOP)
            wait_stopped(proc.pid)
            if saving():
                break
            proc.send_signal(signal.SIGCONT)
        else:
            raise AssertionError("100 checkpoint writes each finished before the process could be stopped")
    else:
        time.sleep(rng.uniform(0.0, 0.05))
    proc.kill()
    proc.wait(timeout=30)
    return True


@pytest.mark.slow
def test_sigkill_at_random_moments_and_mid_save_then_resume_is_exact(tmp_path, data_dir):
    """Three SIGKILLs (seeded random moments; two of them inside a checkpoint write), each followed by
    --init_from=resume: every resume loads the complete ckpt.pt, and the finished run's per-iteration
    losses and weights equal an uninterrupted run's bit for bit."""
    rng = random.Random(7)
    out = tmp_path / "killed"
    cfg = KILL_RUN | dict(checkpoint_interval=1)  # a save every iteration: kills keep landing in them
    kills, kills_in_write, saved_iters = 0, 0, []
    t_start = time.monotonic()
    for launch in range(12):
        resume = (out / "ckpt.pt").exists()  # killed before its first save: start again from scratch
        proc = start_train(out, data_dir, f"launch{launch}", **cfg, init_from="resume" if resume else "scratch")
        try:
            if kills < 3:
                in_write = kills % 2 == 0
                killed = kill_at_a_random_moment(proc, out, in_write, rng)
                kills += killed
                if killed:
                    # A kill inside a write leaves its temporary file behind (the next save removes it).
                    kills_in_write += bool(temp_files(out, proc.pid, prefix=".ckpt"))
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stdout = (tmp_path / f"launch{launch}.out").read_text()
        stderr = (tmp_path / f"launch{launch}.err").read_text()
        if resume:  # never a partial file: no fallback to ckpt.prev.pt was ever needed
            assert f"resuming from {out / 'ckpt.pt'}" in stdout and "warning" not in stdout, stdout + stderr
        for name in ("ckpt.pt", "ckpt.prev.pt"):  # both names always hold complete checkpoints
            if (out / name).exists():
                load_checkpoint(out / name)
        if (out / "ckpt.pt").exists():
            saved_iters.append(load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"])
        print(f"launch {launch}: exit {proc.returncode} at {time.monotonic() - t_start:.1f}s, ckpt iters {saved_iters}, "
              f"kills {kills} ({kills_in_write} in a write)")
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}\n{stderr[-2000:]}"
    assert kills == 3 and kills_in_write >= 1, (kills, kills_in_write)
    assert saved_iters == sorted(saved_iters) and saved_iters[-1] == KILL_RUN["max_iters"]
    assert temp_files(out) == []  # what the kills left mid-write was cleaned up by later saves

    train_tiny(tmp_path / "uninterrupted", data_dir, **KILL_RUN)
    assert losses(out) == losses(tmp_path / "uninterrupted")  # every iteration, bit for bit
    assert [it for it, _ in losses(out)] == list(range(KILL_RUN["max_iters"]))
    final, ref = load_checkpoint(out / "ckpt.pt"), load_checkpoint(tmp_path / "uninterrupted" / "ckpt.pt")
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, final["model"][name]), name


# --- SIGTERM / SIGINT --------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_sigint_and_sighup_save_exit_zero_and_resume_exactly(tmp_path, data_dir):
    """SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C) and SIGHUP (the terminal closed) finish the current
    step, save, and exit 0 within seconds; resuming continues exactly as the uninterrupted run."""
    endless = dict(max_iters=10**6, lr_decay_iters=100, log_interval=1, dropout=0.1)
    procs = {sig: start_train(tmp_path / sig.name, data_dir, sig.name, **endless)
             for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    sent, stopped, at_signal = {}, {}, {}
    try:
        budget = Budget(120, *(proc.pid for proc in procs.values()))
        while len(stopped) < len(procs):  # signal each once it has trained a few steps; time its exit
            assert not budget.spent(), f"no exit after signals {list(sent)}"
            for sig, proc in procs.items():
                if sig not in sent and logged_iters(tmp_path / sig.name) >= 3:
                    proc.send_signal(sig)
                    sent[sig], at_signal[sig] = time.monotonic(), logged_iters(tmp_path / sig.name)
                if sig not in stopped and proc.poll() is not None:
                    assert sig in sent, (tmp_path / f"{sig.name}.err").read_text()[-2000:]
                    stopped[sig] = time.monotonic() - sent[sig]
            time.sleep(0.01)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ends = {}
    for sig, proc in procs.items():
        out, stdout = tmp_path / sig.name, (tmp_path / f"{sig.name}.out").read_text()
        assert proc.returncode == 0, (tmp_path / f"{sig.name}.err").read_text()
        iter_num = load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"]
        # It stops at once: it finishes the step under way (the log may lag the signal by one) and trains
        # no further, however slowly the machine runs. The wall-time bound only catches a hang: a step
        # and a save take milliseconds, the exit 6-8 s at load average 13, more with two suites side by side.
        assert iter_num <= at_signal[sig] + 2, (sig.name, at_signal[sig], iter_num)
        assert stopped[sig] < 120.0, f"{sig.name}: took {stopped[sig]:.1f}s to save and exit"
        assert f"stopped by {sig.name}" in stdout and f"stopped at iter {iter_num};" in stdout
        assert losses(out)[-1][0] == iter_num - 1  # the step under way was finished, then saved
        ends[sig] = iter_num + 5
        train_tiny(out, data_dir, **(endless | dict(init_from="resume", max_iters=ends[sig])))
    train_tiny(tmp_path / "uninterrupted", data_dir, **(endless | dict(max_iters=max(ends.values()))))
    reference = losses(tmp_path / "uninterrupted")
    for sig, end in ends.items():
        assert losses(tmp_path / sig.name) == reference[:end], sig.name


@pytest.mark.slow
def test_sighup_under_nohup_is_left_alone(tmp_path, data_dir):
    """Started under nohup (SIGHUP ignored), train.py leaves SIGHUP ignored: a closed terminal does not stop it,
    and it goes on training until SIGTERM, which saves and exits 0 as always."""
    proc = start_train(tmp_path / "run", data_dir, "run", hangup=signal.SIG_IGN, max_iters=10**6, log_interval=1)
    try:
        assert wait_for(lambda: logged_iters(tmp_path / "run") >= 3, proc, timeout=60)
        proc.send_signal(signal.SIGHUP)
        hung_up_at = logged_iters(tmp_path / "run")
        assert wait_for(lambda: logged_iters(tmp_path / "run") >= hung_up_at + 20, proc, timeout=60), \
            "training stopped after SIGHUP under nohup"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped by SIGTERM" in (tmp_path / "run.out").read_text()
    assert "SIGHUP" not in (tmp_path / "run.out").read_text() + (tmp_path / "run.err").read_text()


# A signal during an eval: honoured between batches. The eval below asks for 2 x 10**7 batches of 8 x 32
# tokens; even at 10 microseconds a forward (far less than this model takes on a CPU core) finishing it costs over
# 200 CPU seconds, so a run that waits for the eval's end cannot exit within EVAL_STOP_CPU_S of its own CPU
# time, while one batch, a save and the interpreter's exit cost a few.
EVAL_STOP_CPU_S = 30.0


@pytest.mark.slow
def test_sigterm_in_a_long_eval_saves_the_last_step_and_exits_zero(tmp_path, data_dir):
    """A run resumed at iter 3 with a huge eval every 5 iterations trains iters 3 and 4, then starts the eval
    at 5: SIGTERM then says so at once, ends the eval at its next batch, saves iter 5 (the last completed
    step, unevaluated) and exits 0, within EVAL_STOP_CPU_S of the process's own CPU time."""
    out = tmp_path / "run"
    train_tiny(out, data_dir, max_iters=3, eval_interval=1000, log_interval=1)
    proc = start_train(out, data_dir, "long_eval", init_from="resume", max_iters=10**6, eval_interval=5,
                       eval_iters=10**7, log_interval=1)
    try:
        assert wait_for(lambda: logged_iters(out) >= 5, proc, timeout=120), (tmp_path / "long_eval.err").read_text()
        time.sleep(0.5)  # into the eval (a signal a moment earlier is seen at its first batch all the same)
        proc.send_signal(signal.SIGTERM)
        budget = Budget(EVAL_STOP_CPU_S, proc.pid)
        while proc.poll() is None:
            assert not budget.spent(), "no exit after SIGTERM during the eval"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = (tmp_path / "long_eval.out").read_text(), (tmp_path / "long_eval.err").read_text()
    assert proc.returncode == 0, stderr
    assert "SIGTERM: stopping after this batch; saving" in stderr
    assert load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"] == 5
    assert "stopped at iter 5; continue with: python train.py --init_from=resume" in stdout
    assert losses(out)[-1][0] == 4 and "step 5:" not in stdout  # no eval result was made up


def test_a_signal_during_start_up_stops_before_training_and_writes_nothing(tmp_path, data_dir, monkeypatch):
    """SIGTERM while the model is being built: the run stops at the next phase with one line and exit
    128 + 15, before training, writing nothing (not even config.json)."""
    real_build = train.build_model

    def build_then_signal(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build(*args)
    monkeypatch.setattr(train, "build_model", build_then_signal)
    steps = spy_optimizer_steps(monkeypatch)
    result = run_main(train.main, train_argv(out_dir=tmp_path / "out", data_dir=data_dir))
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "stopped by SIGTERM before training started; nothing was written"
    assert "SIGTERM: stopping before training starts" in result.stderr
    assert steps == [] and not (tmp_path / "out").exists()


def test_a_signal_during_eval_py_ends_it_at_the_next_batch(tmp_path, data_dir, monkeypatch):
    """eval.py: SIGINT after its second batch of windows ends the evaluation there, with one line, exit 130."""
    import eval as evallib
    from core.evaluation import perplexity

    train_tiny(tmp_path, data_dir, max_iters=2)
    real, batches = perplexity.token_losses, []

    def count_then_signal(*args):
        batches.append(1)
        if len(batches) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)
    monkeypatch.setattr(perplexity, "token_losses", count_then_signal)
    result = run_main(evallib.main, [f"--out_dir={tmp_path}", "--device=cpu", "--batch_size=1", "--block_size=8"])
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "stopped by SIGINT during the evaluation; no result"
    assert len(batches) == 2 and result.stdout == ""


def torch_loading(pid: int) -> bool:
    """Whether the process has mapped libtorch: it is inside `import torch`, whose Python part takes a
    second or more after that (sympy, the op registrations), so a signal sent now lands in the imports."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the import under way")
@pytest.mark.parametrize("script", ["train.py", "eval.py", "serve.py"])
def test_ctrl_c_during_the_imports_is_one_line(script):
    """Ctrl-C in the seconds a script spends importing torch (before main, before any stop flag) exits
    at once with one line and 130, not Python's KeyboardInterrupt traceback (core.errors.quiet_start)."""
    proc = subprocess.Popen([sys.executable, script, "--out_dir=/nonexistent"], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | ONE_THREAD_ENV)
    try:
        deadline = time.monotonic() + 60
        while not torch_loading(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    # the signal may land after the imports on a slow machine: then main's own handling says it, in one line
    assert err.splitlines() in (["error: interrupted while starting"], ["error: interrupted"]), err
    assert out == ""


# --- damaged checkpoints -----------------------------------------------------------------------

SHORT_RUN = dict(max_iters=6, lr_decay_iters=10, log_interval=1, checkpoint_interval=2, dropout=0.1)


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
        return
    flip_a_weight_bit(path)


@pytest.fixture(scope="module")
def reference_10(tmp_path_factory, data_dir):
    """Per-iteration losses of an uninterrupted SHORT_RUN to 10 iterations."""
    out = tmp_path_factory.mktemp("reference_10")
    train_tiny(out, data_dir, **(SHORT_RUN | dict(max_iters=10)))
    return losses(out)


@pytest.mark.parametrize("how", ["truncated", "bit_flipped"])
def test_damaged_checkpoint_is_refused_and_resume_uses_the_previous_one(tmp_path, data_dir, reference_10, how):
    train_tiny(tmp_path, data_dir, **SHORT_RUN)  # ckpt.pt at iter 6, ckpt.prev.pt at iter 4
    damage(tmp_path / "ckpt.pt", how)
    with pytest.raises(UserError, match="ckpt.pt is truncated or corrupt"):  # loading exactly this file
        load_checkpoint(tmp_path / "ckpt.pt")

    result = run_main(train.main, train_argv(out_dir=tmp_path, data_dir=data_dir,
                                             **(SHORT_RUN | dict(max_iters=10, init_from="resume"))))
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "ckpt.pt is truncated or corrupt" in warning[0], result.stdout
    assert f"using the older complete checkpoint {tmp_path / 'ckpt.prev.pt'} (iter 4)" in warning[0]
    assert losses(tmp_path) == reference_10  # iterations 4 and 5 were redone, exactly


def test_no_intact_checkpoint_is_one_clear_error(tmp_path, data_dir):
    train_tiny(tmp_path, data_dir, **SHORT_RUN)
    argv = train_argv(out_dir=tmp_path, data_dir=data_dir, **(SHORT_RUN | dict(max_iters=10, init_from="resume")))
    damage(tmp_path / "ckpt.pt", "truncated")
    damage(tmp_path / "ckpt.prev.pt", "bit_flipped")
    assert_user_error(run_main(train.main, argv), "no intact checkpoint", "ckpt.pt is truncated",
                      "ckpt.prev.pt is truncated or corrupt")
    (tmp_path / "ckpt.prev.pt").unlink()  # and with no older checkpoint at all
    assert_user_error(run_main(train.main, argv), "ckpt.pt is truncated or corrupt")



def test_a_scripts_resume_reads_exactly_the_newest_file_of_either_kind(tmp_path):
    """sample.py, eval.py and export.py (resolver.load_model's resume) read out_dir's ckpt.pt, else fsdp's ckpt.dcp,
    exactly that one: a damaged one is an error that names the previous checkpoint, never a silent fall back."""
    from core.weights import resolver

    (tmp_path / "ckpt.dcp").mkdir()
    (tmp_path / "ckpt.prev.dcp").mkdir()
    with pytest.raises(UserError, match=r"ckpt.dcp \(no meta.json\).*ckpt.prev.dcp holds the checkpoint saved before"):
        resolver.load_model("resume", tmp_path)

# --- init_from=auto: one command starts a run and continues it -----------------------------------

def test_init_from_auto_starts_then_resumes_exactly_and_refuses_another_model(tmp_path, data_dir, reference_10):
    """The same command twice: the first starts from scratch in an empty out_dir, the second (after a
    stop at iteration 6) resumes it as --init_from=resume would, to losses equal to an uninterrupted run's.
    A command whose model differs from the checkpoint's is refused in one line, as resume refuses it."""
    auto = SHORT_RUN | dict(init_from="auto")
    first = run_main(train.main, train_argv(out_dir=tmp_path, data_dir=data_dir, **auto))
    assert first.returncode == 0 and "resuming" not in first.stdout, first.stderr
    second = run_main(train.main, train_argv(out_dir=tmp_path, data_dir=data_dir, **(auto | dict(max_iters=10))))
    assert second.returncode == 0, second.stderr
    assert f"resuming from {tmp_path / 'ckpt.pt'} at iter 6" in second.stdout
    assert losses(tmp_path) == reference_10
    assert_user_error(run_main(train.main, train_argv(out_dir=tmp_path, data_dir=data_dir, **auto, n_layer=2)),
                      "config n_layer=2 differs from the checkpoint's 1")


def test_init_from_auto_continues_from_the_previous_checkpoint_alone(tmp_path, data_dir):
    """A kill between a save's two renames can leave only the previous checkpoint: auto resumes it, never
    starts afresh over it."""
    assert loop.auto_init_from(tmp_path) == "scratch"
    (tmp_path / "ckpt.prev.dcp").mkdir()
    assert loop.auto_init_from(tmp_path) == "resume"


def test_a_failed_save_names_the_previous_checkpoint_when_it_is_the_only_one(tmp_path):
    """What a failed save's line offers to go on from: with no ckpt.pt, the ckpt.prev.pt beside it."""
    assert checkpointing.last_intact(tmp_path) == "no checkpoint was saved yet"
    checkpointing.save_checkpoint(tmp_path, {"iter_num": 3}, {})
    (tmp_path / "ckpt.pt").rename(tmp_path / "ckpt.prev.pt")
    assert f"{tmp_path / 'ckpt.prev.pt'} (iter 3), is untouched" in checkpointing.last_intact(tmp_path)


@pytest.mark.slow
def test_ranks_that_decide_auto_differently_are_refused(tmp_path, data_dir):
    """torchrun, 2 gloo processes, --init_from=auto, each rank given its own out_dir by a config file (as nodes
    whose out_dir is not one shared directory would see it): rank 0's holds a checkpoint, rank 1's does not.
    Rank 0 would resume and rank 1 start afresh; train.py stops both in one line before either trains or
    writes (preflight.check_ranks_agree)."""
    train_tiny(tmp_path / "out0", data_dir, max_iters=2, eval_interval=2)
    before = (tmp_path / "out0" / "ckpt.pt").read_bytes()
    per_rank = tmp_path / "per_rank.py"
    per_rank.write_text(f"import os\nout_dir = {str(tmp_path)!r} + '/out' + os.environ['RANK']\n")
    argv = [a for a in train_argv(data_dir=data_dir, init_from="auto", max_iters=4, dist_timeout_s=30.0)]
    job = subprocess.run([sys.executable, *TORCHRUN, "--max-restarts=0", "train.py", str(per_rank), *argv],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, env=os.environ | ONE_THREAD_ENV)
    assert job.returncode != 0
    assert "holds a checkpoint on some ranks and not on others" in job.stderr, job.stderr[-3000:]
    assert (tmp_path / "out0" / "ckpt.pt").read_bytes() == before  # rank 0 resumed nothing, saved nothing
    assert not (tmp_path / "out1").exists()  # rank 1 started nothing


# --- a non-finite loss -------------------------------------------------------------------------

def record_saves(monkeypatch) -> list[bytes]:
    """Make every checkpointing.save_checkpoint also append the bytes it wrote to the returned list."""
    saved, save_checkpoint = [], checkpointing.save_checkpoint

    def recorded_save(*args, **kwargs):
        path = save_checkpoint(*args, **kwargs)
        saved.append(path.read_bytes())
        return path

    monkeypatch.setattr(checkpointing, "save_checkpoint", recorded_save)
    return saved


def test_nonfinite_loss_stops_before_the_optimizer_step(tmp_path, data_dir, monkeypatch):
    """A NaN loss at iteration 5 (injected into the model's forward pass): exit 2 with the iteration
    and the value in one line, no optimizer step on it, and the checkpoint saved just before it
    (iteration 5) byte for byte as it was written."""
    bad_iter, forward = 5, modellib.GPT.forward
    calls = {"train_forward": 0}

    def forward_with_nan_at_bad_iter(self, idx, targets=None, **kwargs):
        logits, loss = forward(self, idx, targets, **kwargs)
        if self.training:  # one micro-step per iteration; eval passes run with training=False
            if calls["train_forward"] == bad_iter:
                loss = loss * float("nan")
            calls["train_forward"] += 1
        return logits, loss

    saved = record_saves(monkeypatch)
    steps = spy_optimizer_steps(monkeypatch)
    monkeypatch.setattr(modellib.GPT, "forward", forward_with_nan_at_bad_iter)
    result = run_main(train.main, train_argv(out_dir=tmp_path, data_dir=data_dir, max_iters=20, checkpoint_interval=1))
    assert_user_error(result, "loss is nan at iter 5", "stopped before the optimizer step")
    assert len(steps) == bad_iter  # iterations 0..4 stepped; 5 did not
    assert (tmp_path / "ckpt.pt").read_bytes() == saved[-1]
    state = load_checkpoint(tmp_path / "ckpt.pt")
    assert state["meta"]["iter_num"] == bad_iter
    assert all(torch.isfinite(t).all() for t in state["model"].values())


# --- a full disk -------------------------------------------------------------------------------

def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["checkpoint", "previous_copy", "log"])
def test_disk_full_keeps_the_previous_checkpoint(tmp_path, data_dir, reference_10, monkeypatch, where):
    """The disk fills after the save at iteration 2: while torch.save writes the next checkpoint, while
    the previous one is copied aside (a filesystem without hard links), or while the log is appended.
    The run stops with one line naming the cause; ckpt.pt is byte-identical to the last good save and
    no temporary file is left; once there is space again, resume continues exactly."""
    real_save, real_open = torch.save, open
    saved = record_saves(monkeypatch)

    def torch_save_fills_disk(obj, f, *args, **kwargs):
        if not saved:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: buffer.tell() // 3])  # part of it fits, then the disk is full
        raise no_space(f.name)

    def link_unsupported(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(dst))

    def copy_fills_disk(src, dst, *args, **kwargs):
        Path(dst).write_bytes(Path(src).read_bytes()[:1000])
        raise no_space(dst)

    def open_log_fills_disk(file, mode="r", *args, **kwargs):
        if saved and "a" in mode and Path(file).name == "log.jsonl":
            raise no_space(file)
        return real_open(file, mode, *args, **kwargs)

    if where == "checkpoint":
        monkeypatch.setattr(torch, "save", torch_save_fills_disk)
    elif where == "previous_copy":
        monkeypatch.setattr(os, "link", link_unsupported)
        monkeypatch.setattr(shutil, "copyfile", copy_fills_disk)
    else:
        monkeypatch.setattr(runlog, "open", open_log_fills_disk, raising=False)  # the log's one home
    result = run_main(train.main, train_argv(out_dir=tmp_path, data_dir=data_dir, **SHORT_RUN))
    written = tmp_path / ("log.jsonl" if where == "log" else "ckpt.pt")
    assert_user_error(result, f"no space left to write {written} (No space left on device", "it needs about",
                      f"the last intact checkpoint, {tmp_path / 'ckpt.pt'} (iter 2), is untouched")
    assert len(saved) == 1 and (tmp_path / "ckpt.pt").read_bytes() == saved[0]
    assert load_checkpoint(tmp_path / "ckpt.pt")["meta"]["iter_num"] == 2
    assert temp_files(tmp_path) == []

    monkeypatch.undo()  # space again
    train_tiny(tmp_path, data_dir, **(SHORT_RUN | dict(max_iters=10, init_from="resume")))
    assert losses(tmp_path) == reference_10


@pytest.fixture
def small_disk(tmp_path):
    """A real 320 kB filesystem (tmpfs): one SHORT_RUN checkpoint (~205 kB) fits, a second beside it does not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_really_full_disk_is_one_line_and_resume_is_exact(tmp_path, small_disk, data_dir, reference_10):
    """Training into a 320 kB tmpfs: the second save cannot fit. The run ends with one line naming the file,
    the space it needed and the checkpoint that is intact; no temporary file is left; moved to a disk with
    space, the run resumes from that checkpoint exactly."""
    out = small_disk / "out"
    result = run_main(train.main, train_argv(out_dir=out, data_dir=data_dir, **SHORT_RUN))
    assert_user_error(result, f"no space left to write {out / 'ckpt.pt'} (No space left on device", "it needs about",
                      "KiB is free",
                      f"the last intact checkpoint, {out / 'ckpt.pt'} (iter 2), is untouched")
    assert temp_files(out) == []
    assert load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"] == 2
    moved = shutil.copytree(out, tmp_path / "moved")
    train_tiny(moved, data_dir, **(SHORT_RUN | dict(max_iters=10, init_from="auto")))
    assert losses(moved) == reference_10


def fill(mount: Path, leave: int) -> None:
    """Take all but `leave` bytes of the filesystem at mount."""
    (mount / "filler").write_bytes(b"\0" * (shutil.disk_usage(mount).free - leave))


@pytest.mark.parametrize("what", ["prepare", "export"])
def test_a_really_full_disk_while_preparing_or_exporting_is_one_line(tmp_path, small_disk, data_dir, what):
    """data/text/prepare.py and export.py into a tmpfs with 16 kB left: one line naming the path and what is
    free, exit 2, and nothing left behind (no temporary file, no half folder)."""
    fill(small_disk, 16_000)
    if what == "prepare":
        (tmp_path / "book.txt").write_text(TEXT * 10)  # 50,000 characters: 100 kB of uint16 ids
        result = run_script("data/text/prepare.py", f"--input={tmp_path / 'book.txt'}", "--tokenizer=char",
                            f"--out_dir={small_disk / 'data'}")
        assert_user_error(result, f"no space left to write {small_disk / 'data'}", "KiB is free",
                          "the dataset's earlier files are as they were")
        assert sorted(os.listdir(small_disk / "data")) == []
    else:
        needs_transformers()
        import export
        train_tiny(tmp_path / "run", data_dir, max_iters=2, n_embd=64, n_head=2)  # ~0.1 MB of weights
        result = run_main(export.main, [f"--out_dir={tmp_path / 'run'}", f"--hf_dir={small_disk / 'hf'}"])
        assert_user_error(result, f"no space left to write {small_disk / 'hf'}", "it needs about", "KiB is free",
                          "nothing was written there")
    assert sorted(os.listdir(small_disk)) == (["data", "filler"] if what == "prepare" else ["filler"])


def test_a_full_disk_in_a_library_writer_is_one_line(tmp_path, data_dir, monkeypatch):
    """Where no tmpfs can be mounted: ENOSPC as a token file's write and safetensors' own error for it (its
    Rust writer's text) each become the one line, with the partial file or folder removed."""
    from core.data import writer

    class FullFile(io.FileIO):
        def write(self, data):
            super().write(bytes(data)[:100])
            raise no_space(self.name)

    monkeypatch.setattr(writer, "open", lambda path, mode: FullFile(path, mode), raising=False)
    with pytest.raises(UserError, match=r"no space left to write .*train.bin .*it needs about 2.0 KiB"):
        writer.write_tokens(tmp_path / "train.bin", list(range(1000)))
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()

    transformers = needs_transformers()
    import export

    def safetensors_full(self, directory, *args, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"part")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", safetensors_full)
    train_tiny(tmp_path / "run", data_dir, max_iters=2)
    result = run_main(export.main, [f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])
    assert_user_error(result, f"no space left to write {tmp_path / 'hf'}", "nothing was written there")
    assert sorted(os.listdir(tmp_path)) == ["run"]


# --- a dataset changed under a run ---------------------------------------------------------------

@pytest.mark.parametrize("how", ["truncated", "replaced"])
def test_a_dataset_file_changed_while_training_reads_it_is_one_line(tmp_path, monkeypatch, how):
    """train.bin cut short (reading past its new end through the memory map would be a bus error) or replaced
    by another prepare.py (other tokens, in silence) after the save at iteration 2: the run stops with one
    line naming the file, and the checkpoint it saved is intact."""
    data = tmp_path / "data"
    make_char_dataset(data, TEXT)

    def change(optimizer, steps):
        if steps == 3:
            path = data / "train.bin"
            if how == "truncated":
                os.truncate(path, path.stat().st_size // 2)
            else:
                replacement = tmp_path / "train.bin.new"
                shutil.copy(path, replacement)
                os.replace(replacement, path)

    spy_optimizer_steps(monkeypatch, after=change)
    result = run_main(train.main, train_argv(out_dir=tmp_path / "out", data_dir=data, **SHORT_RUN))
    assert_user_error(result, f"{data / 'train.bin'} {'changed size (' if how == 'truncated' else 'was replaced'}",
                      "while training reads it", "the last checkpoint is intact")
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["meta"]["iter_num"] == 2


# --- an unwritable out_dir ---------------------------------------------------------------------

@pytest.mark.parametrize("where", ["under_a_file", "is_a_file"])
def test_unwritable_out_dir_fails_before_any_training(tmp_path, data_dir, monkeypatch, where):
    """Tests run as root, whom chmod does not stop; a path through a regular file stops everyone."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    out_dir = blocker / "out" if where == "under_a_file" else blocker
    built = []
    monkeypatch.setattr(train, "build_model", lambda *args: built.append(args))
    result = run_main(train.main, train_argv(out_dir=out_dir, data_dir=data_dir))
    assert_user_error(result, f"cannot write to out_dir '{out_dir}'", "choose a writable --out_dir")
    assert built == [] and result.stdout == ""
    assert blocker.read_text() == "not a directory\n"


def test_a_read_only_out_dir_fails_before_any_training(tmp_path, small_disk, data_dir):
    """A run on a filesystem mounted read-only (root is not stopped by chmod, but is by this): one line
    before any training, for a new run and for a resume alike; the checkpoint there still samples."""
    train_tiny(small_disk / "out", data_dir, **(SHORT_RUN | dict(max_iters=2)))  # one checkpoint fits
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    for init_from in ("scratch", "resume", "auto"):
        result = run_main(train.main, train_argv(out_dir=small_disk / "new" if init_from == "scratch" else
                                                 small_disk / "out", data_dir=data_dir, init_from=init_from))
        assert_user_error(result, "cannot write to out_dir", "Read-only file system", "choose a writable --out_dir")
    assert load_checkpoint(small_disk / "out" / "ckpt.pt")["meta"]["iter_num"] == 2


# --- torchrun: a rank dies ---------------------------------------------------------------------

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor-interval=0.1")
DDP_RUN = dict(gradient_accumulation_steps=2, max_iters=30, lr_decay_iters=30, log_interval=1, eval_interval=1000,
               checkpoint_interval=1, dist_timeout_s=30.0)


def kill_rank(proc: subprocess.Popen, rank: int, out_dir: Path, after_iter: int, mid_save: bool = False,
              mid_eval: bool = False) -> None:
    """SIGKILL torchrun's worker of `rank` once out_dir/log.jsonl reaches iteration `after_iter` (mid-step), or
    (mid_save, rank 0) at its next checkpoint write after that, frozen while its temporary file exists, or
    (mid_eval) inside the eval at after_iter + 1: frozen while the log holds after_iter's step and not that
    eval's record, an eval of many batches long after its start."""
    def reached() -> bool:
        """the job to reach the iteration"""
        return last_logged_iter(out_dir) >= after_iter

    assert wait_for(reached, proc, timeout=120, poll=0.02), "the job ended before the kill"
    workers = {int(process_env(pid).get("RANK", -1)): pid for pid in child_pids(proc.pid)}
    pid = workers[rank]
    if mid_eval:
        time.sleep(0.05)  # into the eval, which takes hundreds of milliseconds
        os.kill(pid, signal.SIGSTOP)
        wait_stopped(pid)
        evaluated = [r["iter"] for r in log_records(out_dir) if "val_loss" in r]
        assert last_logged_iter(out_dir) == after_iter and after_iter + 1 not in evaluated, "not mid-eval"
    if mid_save:
        def saving() -> bool:
            """rank 0 writing a checkpoint"""
            return bool(temp_files(out_dir, pid, prefix=".ckpt"))

        for _ in range(100):  # as kill_at_a_random_moment: stop it, and kill it only if still mid-write
            assert wait_for(saving, proc, timeout=60, poll=0.0005), "the job ended before the kill"
            os.kill(pid, signal.SIGSTOP)
            wait_stopped(pid)
            if saving():
                break
            os.kill(pid, signal.SIGCONT)
        else:
            raise AssertionError("100 checkpoint writes each finished before the process could be stopped")
    os.kill(pid, signal.SIGKILL)


def stop_job(proc: subprocess.Popen) -> None:
    """Kill torchrun and its workers if the test left them running."""
    if proc.poll() is None:
        workers = child_pids(proc.pid)
        proc.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


@pytest.mark.slow
def test_torchrun_rank_killed_ends_the_job_or_restarts_it_from_the_checkpoint(tmp_path, data_dir):
    """torchrun with 2 gloo processes and --init_from=auto, one worker SIGKILLed. With --max-restarts=0
    the job ends within seconds, non-zero, naming the dead rank (killed mid-step). The same command with
    --max-restarts=2, its rank 1 killed inside an eval and then its rank 0 inside a checkpoint write: torchrun
    restarts both workers each time, auto resumes them from the newest complete checkpoint, and the run
    completes with per-iteration losses equal to an uninterrupted 2-process run's bit for bit. Nothing hangs:
    every wait here is bounded, and dist_timeout_s bounds any collective a dead peer would block."""
    out, auto = tmp_path / "ddp", DDP_RUN | dict(init_from="auto", eval_interval=10, eval_iters=200)
    reference = start_train(tmp_path / "reference", data_dir, "reference", launcher=TORCHRUN, **auto)
    job = start_train(out, data_dir, "no_restart", launcher=(*TORCHRUN, "--max-restarts=0"), **auto)
    try:
        kill_rank(job, rank=1, out_dir=out, after_iter=4)
        killed = time.monotonic()
        job.wait(timeout=60)
        assert time.monotonic() - killed < 45
    finally:
        stop_job(job)
    stderr = (tmp_path / "no_restart.err").read_text()
    assert job.returncode != 0
    assert "Root Cause" in stderr and "rank      : 1" in stderr and "Signal 9 (SIGKILL)" in stderr, stderr[-3000:]
    first_stop = load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"]

    job = start_train(out, data_dir, "restart", launcher=(*TORCHRUN, "--max-restarts=2"), **auto)
    try:
        eval_at = (first_stop // 10 + 1) * 10
        kill_rank(job, rank=1, out_dir=out, after_iter=eval_at - 1, mid_eval=True)
        kill_rank(job, rank=0, out_dir=out, after_iter=eval_at + 3, mid_save=True)
        job.wait(timeout=180)
        reference.wait(timeout=180)
    finally:
        stop_job(job)
        stop_job(reference)
    stdout = (tmp_path / "restart.out").read_text()
    assert job.returncode == 0, (tmp_path / "restart.err").read_text()[-3000:]
    assert reference.returncode == 0, (tmp_path / "reference.err").read_text()[-3000:]
    resumed = [int(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("resuming from")]
    assert len(resumed) == 3 and first_stop <= resumed[0] < resumed[1] < resumed[2], stdout  # each a newer save
    assert resumed[1] == eval_at - 1  # killed in the eval at eval_at: before its save, after eval_at - 1's
    assert "resuming" not in (tmp_path / "reference.out").read_text()  # auto in an empty out_dir: scratch
    assert load_checkpoint(out / "ckpt.pt")["meta"]["iter_num"] == DDP_RUN["max_iters"]
    assert temp_files(out) == []
    assert losses(out) == losses(tmp_path / "reference")
    assert [it for it, _ in losses(out)] == list(range(DDP_RUN["max_iters"]))
