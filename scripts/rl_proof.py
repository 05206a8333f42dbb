"""Proof that RL learns beyond SFT: held-out exact match after SFT, after SFT then RL, and after SFT continued for
the RL stage's time, for each task and seed (docs/chat.md).

    python scripts/rl_proof.py                          # needs the base run: the README's CPU quick start
    python scripts/rl_proof.py --seeds=1337 --rl_args=--max_iters=100

Runs, from the repo root, one command at a time with one thread (OMP_NUM_THREADS=1, --threads=1), so that wall
times compare: data/chat/tasks.py and data/chat/prepare.py (docs/chat.md's chat quick start), then per seed
train.py with config/sft_tasks_char.py, rl.py with config/rl_tasks_char.py from that fine-tune, and train.py
continuing the fine-tune (a new run from its weights, the same schedule) for as many iterations as the
fine-tune ran in the RL stage's time (CPU seconds: one thread each, so on a quiet machine the wall time too);
then eval.py --task=NAME on each task's 200 held-out problems (greedy) for the three models. Prints a markdown
table; each run's out_dir is out-*-s<seed>.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

BASE = "out-shakespeare-char-cpu"
SFT = ["config/train_shakespeare_char_cpu.py", "config/sft_tasks_char.py"]
RL = ["config/rl_tasks_char.py"]
TASKS = ("reverse", "upper")
ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run(cmd: list[str]) -> tuple[str, float, float]:
    """Run `python cmd...` to completion with one thread: (stdout, wall s, CPU s)."""
    t0, before = time.perf_counter(), os.times()
    result = subprocess.run([sys.executable, *cmd, *(["--threads=1"] if cmd[0] in ("train.py", "rl.py") else [])],
                            capture_output=True, text=True, env=ENV)
    wall, after = time.perf_counter() - t0, os.times()
    if result.returncode:
        sys.exit(f"failed: python {shlex.join(cmd)}\n{result.stderr[-2000:]}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return result.stdout, wall, cpu


def iterations(out_dir: str) -> int:
    """The last iteration a run logged."""
    lines = (Path(out_dir) / "log.jsonl").read_text().splitlines()
    return max(json.loads(line)["iter"] for line in lines)


def accuracy(out_dir: str, task: str) -> str:
    line = run(["eval.py", f"--out_dir={out_dir}", f"--task={task}"])[0]
    return line.split("exact match ")[1].split(",")[0]  # '0.4150 (83/200)'


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1337,1338", help="comma-separated: one SFT, RL and continued SFT each")
    parser.add_argument("--rl_args", default="", help="extra rl.py arguments, e.g. --max_iters=100")
    args = parser.parse_args(argv)
    run(["data/chat/tasks.py"])
    run(["data/chat/prepare.py", "--input=data/chat/tasks_train.jsonl", f"--tokenizer_from={BASE}", "--block_size=64"])
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        sft, rl, more = (f"out-{name}-s{seed}" for name in ("sft-tasks-char", "rl-tasks-char", "sft-more-tasks-char"))
        _, sft_wall, sft_cpu = run(["train.py", *SFT, f"--seed={seed}", f"--out_dir={sft}", "--overwrite=True"])
        _, rl_wall, rl_cpu = run(["rl.py", *RL, f"--init_from={sft}", f"--seed={seed}", f"--out_dir={rl}",
                                  "--overwrite=True", *shlex.split(args.rl_args)])
        # The fine-tune's pace, for the RL stage's time: CPU seconds, which other processes on the machine do not
        # stretch as they do wall seconds (each command runs on one thread, so on a quiet machine they are equal).
        n = max(1, round(rl_cpu / sft_cpu * iterations(sft)))
        _, more_wall, more_cpu = run(["train.py", *SFT, f"--init_from={sft}", f"--seed={seed}", f"--out_dir={more}",
                                      f"--max_iters={n}", f"--lr_decay_iters={n}", f"--warmup_iters={min(50, n // 10)}",
                                      f"--eval_interval={n}", "--overwrite=True"])
        rows += [(seed, "SFT", f"{sft_wall:.0f} ({sft_cpu:.0f})", sft),
                 (seed, "SFT, then RL", f"+ {rl_wall:.0f} ({rl_cpu:.0f})", rl),
                 (seed, f"SFT, then {n} more SFT iterations", f"+ {more_wall:.0f} ({more_cpu:.0f})", more)]
    print("| seed | model | wall s (CPU s) | " + " | ".join(f"{t}, held-out exact match" for t in TASKS) + " |")
    print("|---|---|---|" + "---|" * len(TASKS))
    for seed, name, seconds, out_dir in rows:
        print(f"| {seed} | {name} | {seconds} | " + " | ".join(accuracy(out_dir, t) for t in TASKS) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
