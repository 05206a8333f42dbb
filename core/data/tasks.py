"""Tasks whose answers a program can check: a prompt generator and a checker, one pair per task (docs/chat.md).

    task = TASKS["add"]
    problem = task.make(random.Random(0))      # Problem(prompt='add: 874+62', answer='936', key='874+62')
    task.check(problem, "936")                 # 1.0: a reward in [0, 1]
    problems("sort", "longer", 200)            # a split's evaluation set: eval.py --task=sort --task_split=longer

A hash of the problem's key puts one key in ten on the held-out side, whatever seed or count drew it. sort and
palindrome are checked only (levels): past a few demonstrations their problems carry no answer. The five splits:
demos and demos_heldout (Task.demos's), train and heldout (Task.make's), longer (Task.longer's, held-out keys).
"""
import dataclasses
import random
import string
import zlib
from typing import Callable

from core.errors import UserError

HELDOUT_EVERY = 10   # one key in ten is held out
HELDOUT_SEED = 0     # the sets everyone scores: the first N distinct problems of a held-out split from this seed
SCARCE = 0.02  # the share of sort's and palindrome's demonstrations at the train problems' lengths (6 and 7)
SPLITS = ("train", "heldout", "longer", "demos", "demos_heldout")


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str   # the user's message
    answer: str | None  # an accepted answer: what SFT learns, what exact_match compares; None: checked only
    key: str      # what the problem is made from; it decides the split


@dataclasses.dataclass(frozen=True)
class Task:
    make: Callable[[random.Random], Problem]     # one problem, drawn with rng: the train and held-out splits'
    check: Callable[[Problem, str], float]       # (problem, the model's reply) -> reward in [0, 1]; 1: accepted
    demos: Callable[[random.Random], Problem] | None = None   # easier problems, the only ones shown with answers
    longer: Callable[[random.Random], Problem] | None = None  # harder ones, never trained on: the longer split


def split_of(key: str) -> str:
    """'heldout' for one key in HELDOUT_EVERY, else 'train': a fixed hash (crc32), the same on every machine."""
    return "heldout" if zlib.crc32(key.encode()) % HELDOUT_EVERY == 0 else "train"


def exact_match(problem: Problem, reply: str) -> float:
    return float(reply == problem.answer)


# -----------------------------------------------------------------------------
# the tasks


def random_letters(rng: random.Random, min_len: int = 3, max_len: int = 6, spaces: bool = True) -> str:
    """Lowercase letters, with a space now and then (never first or last, never two together)."""
    n = rng.randint(min_len, max_len)
    chars = [rng.choice(string.ascii_lowercase) for _ in range(n)]
    for i in range(1, n - 1):
        if spaces and rng.random() < 0.15 and chars[i - 1] != " ":
            chars[i] = " "
    return "".join(chars)


def make_reverse(rng: random.Random) -> Problem:
    text = random_letters(rng)
    return Problem(f"reverse: {text}", text[::-1], text)


def make_upper(rng: random.Random) -> Problem:
    text = random_letters(rng)
    return Problem(f"upper: {text}", text.upper(), text)


def make_add(rng: random.Random) -> Problem:
    """Two- and three-digit addition, the answer in digits alone: 'add: 874+62' -> '936'."""
    a, b = (rng.randint(10, 999) for _ in range(2))
    return Problem(f"add: {a}+{b}", str(a + b), f"{a}+{b}")


def make_sort(rng: random.Random, lengths: tuple[int, ...]) -> Problem:
    """The letters in alphabetical order: 'sort: dbcab' -> 'abbcd'. One right answer."""
    text = random_letters(rng, *[rng.choice(lengths)] * 2, spaces=False)
    return Problem(f"sort: {text}", "".join(sorted(text)), text)


def check_sort(problem: Problem, reply: str) -> float:
    return float(reply == "".join(sorted(problem.key)))


def make_palindrome(rng: random.Random, lengths: tuple[int, ...]) -> Problem:
    """A palindrome that starts with the letters: 'palindrome: abc' -> 'abcba', 'abccba', 'abcxcba', ... Many
    answers; a demonstration shows one of the two shortest, at random."""
    text = random_letters(rng, *[rng.choice(lengths)] * 2, spaces=False)
    return Problem(f"palindrome: {text}", text + text[len(text) - 1 - rng.randint(0, 1)::-1], text)


def check_palindrome(problem: Problem, reply: str) -> float:
    return float(reply == reply[::-1] and reply.startswith(problem.key) and reply.isalpha() and reply.islower())


def levels(make: Callable[[random.Random, tuple[int, ...]], Problem], check: Callable[[Problem, str], float]) -> Task:
    """A checked task by length (docs/chat.md): demonstrations of 3, 4, 5, 8 letters and a few of 6 or 7 (with none,
    learned positions score 0 there), train and held-out problems 6 and 7, longer ones 9 and 10."""
    return Task(lambda rng: make(rng, (6, 7)), check,
                demos=lambda rng: make(rng, (6, 7) if rng.random() < SCARCE else (3, 4, 5, 8)),
                longer=lambda rng: make(rng, (9, 10)))


TASKS: dict[str, Task] = {
    "reverse": Task(make_reverse, exact_match),
    "upper": Task(make_upper, exact_match),
    "add": Task(make_add, exact_match),
    "sort": levels(make_sort, check_sort),
    "palindrome": levels(make_palindrome, check_palindrome),
}


# -----------------------------------------------------------------------------
# drawing problems


def task_names(names: str) -> list[str]:
    """'reverse,upper' -> ['reverse', 'upper'], each a registered task: the one check of a tasks setting."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in TASKS]
    if unknown or not chosen:
        raise UserError(f"unknown task {', '.join(map(repr, unknown)) or repr(names)}; tasks are "
                        f"{', '.join(TASKS)} (core/data/tasks.py), comma-separated")
    if len(set(chosen)) != len(chosen):
        raise UserError(f"tasks {names!r} names a task twice")
    return chosen


def draw(name: str, split: str, rng: random.Random) -> Problem:
    """One problem of task `name` from `split`: drawn with rng until its key falls on that split's side. A task
    without demos shows its train problems as demonstrations; one with demos keeps every other answer back."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    task = TASKS[name]
    make = {"demos": task.demos, "demos_heldout": task.demos, "longer": task.longer}.get(split) or task.make
    if split == "longer" and task.longer is None:
        raise UserError(f"task {name!r} has no longer split; {', '.join(n for n, t in TASKS.items() if t.longer)} do")
    side = "train" if split in ("train", "demos") else "heldout"
    for _ in range(100 * HELDOUT_EVERY):
        problem = make(rng)
        if split_of(problem.key) == side:
            shown = task.demos is None or split.startswith("demos")
            return problem if shown else dataclasses.replace(problem, answer=None)
    raise UserError(f"task {name!r} drew no {split} problem in {100 * HELDOUT_EVERY} tries; its keys are too few")


def distinct_problems(name: str, split: str, n: int, seed: int | str) -> list[Problem]:
    """n problems of one split with n distinct keys, drawn from seed."""
    rng, by_key = random.Random(seed), {}
    for _ in range(1000 * n):
        if len(by_key) == n:
            break
        problem = draw(name, split, rng)
        by_key.setdefault(problem.key, problem)
    if len(by_key) < n:
        raise UserError(f"task {name!r} has fewer than {n} distinct {split} problems")
    return list(by_key.values())


def problems(name: str, split: str, n: int) -> list[Problem]:
    """A split's evaluation set (heldout, longer, demos_heldout): the same n problems for every run and machine."""
    if split not in ("heldout", "longer", "demos_heldout"):
        raise UserError(f"a task is scored on heldout, longer or demos_heldout, not {split!r}")
    return distinct_problems(name, split, n, HELDOUT_SEED)


def messages(problem: Problem, system: str | None = None) -> list[dict]:
    """The conversation that asks the problem: an optional system message, then the user's prompt."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": problem.prompt}]


def check_vocabulary(names: list[str], encode, what: str) -> None:
    """One line when a task's prompts or answers use characters the model cannot read or write (Shakespeare's
    character vocabulary has no digits); encode raises UserError."""
    for name in names:
        rng = random.Random(0)
        for _ in range(20):  # several problems: the characters vary
            problem = TASKS[name].make(rng)
            try:
                encode(problem.prompt + problem.answer)
            except UserError as e:
                raise UserError(f"task {name!r} does not fit {what}: {e}") from None
