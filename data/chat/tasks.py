"""Synthetic conversations whose answers must be computed from the prompt, split into train and held-out.

    python data/chat/tasks.py                                   # tasks_train.jsonl, tasks_heldout.jsonl here
    python data/chat/tasks.py --out_dir=/tmp/tasks --n_train=4000 --n_heldout=200
    python data/chat/tasks.py --tasks=reverse,upper,add         # add's digits need a BPE base (not characters)

The tasks live in core/data/tasks.py (docs/chat.md): train conversations are their demonstrations, held-out ones
their demos_heldout sets; a quarter of the train conversations carry a system message.
"""
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data import tasks as tasklib  # noqa: E402
from core.data.writer import script_out_dir  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402
from core.fileio import atomic_path  # noqa: E402

SYSTEM = "Do exactly what the user asks."


@dataclasses.dataclass
class TasksConfig:
    out_dir: str | None = None  # default: this script's folder
    tasks: str = "reverse,upper"  # comma-separated, from core/data/tasks.py: reverse, upper, add
    n_train: int = 4000         # train conversations, the tasks drawn at random
    n_heldout: int = 200        # held-out conversations per task
    seed: int = 1337

    def validate(self) -> None:
        if self.n_train < 2 or self.n_heldout < 1:
            raise UserError("need n_train >= 2 and n_heldout >= 1")
        tasklib.task_names(self.tasks)


def conversation(problem: tasklib.Problem, system: bool) -> dict:
    return {"messages": tasklib.messages(problem, SYSTEM if system else None)
            + [{"role": "assistant", "content": problem.answer}]}


def make_sets(cfg: TasksConfig) -> tuple[list[dict], list[dict]]:
    """(train, held-out) conversations: each task's demonstrations, keys distinct per task, none held out."""
    names = tasklib.task_names(cfg.tasks)
    heldout = [conversation(p, False) for name in names for p in tasklib.problems(name, "demos_heldout", cfg.n_heldout)]
    rng = random.Random(cfg.seed)
    picks = [rng.choice(names) for _ in range(cfg.n_train)]
    drawn = {name: tasklib.distinct_problems(name, "demos", picks.count(name), f"{cfg.seed}:{name}") for name in names}
    train = [conversation(drawn[name].pop(), rng.random() < 0.25) for name in picks]
    return train, heldout


def main(argv: Sequence[str]) -> tuple[Path, Path]:
    cfg = parse_args(TasksConfig, argv)
    out_dir = script_out_dir(cfg.out_dir, __file__)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = make_sets(cfg)
    paths = out_dir / "tasks_train.jsonl", out_dir / "tasks_heldout.jsonl"
    for path, convs in zip(paths, (train, heldout)):
        with atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(c) + "\n" for c in convs))
    print(f"wrote {len(train)} train and {len(heldout)} held-out conversations to {paths[0]} and {paths[1]}")
    return paths


if __name__ == "__main__":
    run_cli(main)
