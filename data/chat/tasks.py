"""A synthetic conversation set whose answers must be computed from the prompt, split into train and held-out.

    python data/chat/tasks.py                                   # tasks_train.jsonl, tasks_heldout.jsonl here
    python data/chat/tasks.py --out_dir=/tmp/tasks --n_train=4000 --n_heldout=200

Two tasks on random lowercase words: "reverse: abcde" -> "edcba", "upper: ab cd" -> "AB CD". No
string of the held-out set occurs in the train set, so a model scores on it only by doing the task.
A quarter of the conversations carry a system message. The letters are all in tiny Shakespeare's
character vocabulary, so a character model trained on it can be fine-tuned on these.
"""
import dataclasses
import json
import random
import string
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data.sources import script_out_dir  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402
from core.fileio import atomic_path  # noqa: E402

TASKS = {
    "reverse": lambda s: s[::-1],
    "upper": lambda s: s.upper(),
}
SYSTEM = "Do exactly what the user asks."


@dataclasses.dataclass
class TasksConfig:
    out_dir: str | None = None  # default: this script's folder
    n_train: int = 4000
    n_heldout: int = 200
    min_len: int = 3            # letters in a prompt's string
    max_len: int = 6
    seed: int = 1337

    def validate(self) -> None:
        if self.n_train < 2 or self.n_heldout < 1 or not 1 <= self.min_len <= self.max_len:
            raise UserError("need n_train >= 2, n_heldout >= 1 and 1 <= min_len <= max_len")


def random_text(rng: random.Random, min_len: int, max_len: int) -> str:
    """Lowercase letters, with a space now and then (never first or last)."""
    n = rng.randint(min_len, max_len)
    chars = [rng.choice(string.ascii_lowercase) for _ in range(n)]
    for i in range(1, n - 1):
        if rng.random() < 0.15 and chars[i - 1] != " ":
            chars[i] = " "
    return "".join(chars)


def conversation(task: str, text: str, system: bool) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages += [{"role": "user", "content": f"{task}: {text}"},
                 {"role": "assistant", "content": TASKS[task](text)}]
    return {"messages": messages}


def make_sets(cfg: TasksConfig) -> tuple[list[dict], list[dict]]:
    """(train, held-out) conversations; the held-out strings are distinct from every train string."""
    rng = random.Random(cfg.seed)
    seen, sets = set(), []
    for n in (cfg.n_heldout, cfg.n_train):
        convs = []
        while len(convs) < n:
            text = random_text(rng, cfg.min_len, cfg.max_len)
            if text in seen:
                continue
            seen.add(text)
            convs.append(conversation(rng.choice(sorted(TASKS)), text, rng.random() < 0.25))
        sets.append(convs)
    heldout, train = sets
    return train, heldout


def write_jsonl(path: Path, convs: list[dict]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(c) + "\n" for c in convs))


def main(argv: Sequence[str]) -> tuple[Path, Path]:
    cfg = parse_args(TasksConfig, argv)
    out_dir = script_out_dir(cfg.out_dir, __file__)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = make_sets(cfg)
    paths = out_dir / "tasks_train.jsonl", out_dir / "tasks_heldout.jsonl"
    for path, convs in zip(paths, (train, heldout)):
        write_jsonl(path, convs)
    print(f"wrote {len(train)} train and {len(heldout)} held-out conversations to {paths[0]} and {paths[1]}")
    return paths


if __name__ == "__main__":
    run_cli(main)
