"""Every command in README.md and docs/*.md names files and flags that exist, and the quick start runs.

    python -m pytest tests/test_docs_commands.py

Commands are read from the docs' bash blocks and inline code (`python ...`, `torchrun ...`). Each one's
script and config files must exist, and every --key it passes must be one that script lists in its own
--help (a flag a script does not take fails here before a reader meets it). Then the README's quick start
and the commands that follow it run in order, scaled down (a few iterations, the offline corpus), in a copy
of the repository: each must exit 0 and none may replace an earlier result.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import NO_SHAKESPEARE, ONE_THREAD_ENV, REPO_ROOT, SHAKESPEARE, run_many

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
CORPUS = SHAKESPEARE


def doc_commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) for each python/torchrun command in a markdown file's shell blocks and inline code;
    `&&` chains split, `\\` continuations joined, `$ ` prompts dropped."""
    text, found, in_block, lang = path.read_text(), [], False, ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_block, lang = not in_block, line[3:].strip()
            i += 1
            continue
        start = i + 1
        if in_block and lang in ("", "bash", "sh", "console"):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            found += [(start, part) for part in split_chain(line.removeprefix("$ "))]
        elif not in_block:
            found += [(start, part) for m in re.finditer(r"`((?:python|torchrun) [^`]+)`", line)
                      for part in split_chain(m.group(1))]
        i += 1
    # Inline code broken across two lines of prose.
    for m in re.finditer(r"`((?:python|torchrun) [^`\n]+\n[^`\n]+)`", text):
        found.append((text[:m.start()].count("\n") + 1, " ".join(m.group(1).split())))
    return found


def split_chain(line: str) -> list[str]:
    return [part.strip() for part in line.split("&&") if part.strip().startswith(("python ", "torchrun "))]


def script_of(tokens: list[str]) -> tuple[str | None, list[str]]:
    """(script, its arguments) of `python SCRIPT ...` or `torchrun [options] SCRIPT ...`; None for python -m."""
    if tokens[0] == "python":
        return (None, []) if tokens[1] == "-m" else (tokens[1], tokens[2:])
    rest = tokens[1:]
    while rest and rest[0].startswith("-"):
        rest = rest[1:]
    return rest[0], rest[1:]


def all_commands() -> list[tuple[str, int, str, str, list[str]]]:
    """(doc, line, command, script key, arguments); the script key holds plot.py's subcommand."""
    out = []
    for doc in DOCS:
        for line, command in doc_commands(doc):
            tokens = shlex.split(command, comments=True)
            script, args = script_of(tokens)
            if script is None or "/" in script and script.split("/")[0] not in ("data", "scripts"):
                continue  # python -m ..., or another project's script (llama.cpp's converter)
            if script == "plot.py" and args[:1] == ["attention"]:
                script, args = "plot.py attention", args[1:]
            out.append((doc.name, line, command, script, args))
    return out


COMMANDS = all_commands()


@pytest.fixture(scope="module")
def keys() -> dict[str, set[str]]:
    """The keys of each script documented with flags, as its own --help lists them."""
    scripts = sorted({c[3] for c in COMMANDS if (REPO_ROOT / c[3].split()[0]).is_file()
                      and any(a.startswith("--") for a in c[4])})
    results = run_many([[*s.split(), "--help"] for s in scripts], parallel=3)
    listed = {}
    for script, result in zip(scripts, results):
        assert result.returncode == 0, f"{script} --help: {result.stderr}"
        listed[script] = set(re.findall(r"^\s+(?:-\w, )?--(\w+)", result.stdout, re.M))  # ours: --key=; argparse: --key KEY
        assert listed[script], f"{script} --help lists no keys:\n{result.stdout}"
    return listed


def test_the_docs_hold_commands():
    assert len(COMMANDS) > 60 and {c[3] for c in COMMANDS} >= {"train.py", "sample.py", "eval.py", "plot.py"}


def problems_of(where: str, script: str, args: list[str], keys: dict[str, set[str]], written: set[str]) -> list[str]:
    """What is wrong with one documented command: a missing script or config file, a flag its script does not
    take, a FILE: prompt that neither ships nor is written by the docs (`> name`)."""
    if not (REPO_ROOT / script.split()[0]).is_file():
        return [f"{where}: no script {script}"]
    problems = []
    for arg in args:
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            if key not in keys.get(script, ()) and key != "help":
                problems.append(f"{where}: {script} takes no --{key}")
            if value.startswith("FILE:") and not (REPO_ROOT / value[5:]).exists() and value[5:] not in written:
                problems.append(f"{where}: {value[5:]} neither ships nor is written by the docs")
        elif arg.endswith(".py") and not (REPO_ROOT / arg).is_file():
            problems.append(f"{where}: no file {arg}")
    return problems


@pytest.mark.slow
def test_every_command_names_files_and_flags_that_exist(keys):
    written = {doc.name: set(re.findall(r"> *([\w./-]+)", doc.read_text())) for doc in DOCS}
    problems = [p for doc, line, command, script, args in COMMANDS
                for p in problems_of(f"{doc}:{line}: {command}", script, args, keys, written[doc])]
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_wrong_flag_a_missing_file_and_an_unshipped_prompt():
    keys = {"train.py": {"max_iters"}, "sample.py": {"start"}}
    assert problems_of("x", "train.py", ["config/nope.py", "--max_iter=5", "--max_iters=5"], keys, set()) == [
        "x: no file config/nope.py", "x: train.py takes no --max_iter"]
    assert problems_of("x", "sample.py", ["--start=FILE:p.txt"], keys, set()) == [
        "x: p.txt neither ships nor is written by the docs"]
    assert problems_of("x", "sample.py", ["--start=FILE:p.txt"], keys, {"p.txt"}) == []
    assert problems_of("x", "nope.py", [], keys, set()) == ["x: no script nope.py"]


# The README's commands in the order a reader meets them, scaled down: (command as documented, what is added).
SMALL = "--max_iters=6 --eval_interval=3 --eval_iters=2 --log_interval=3 --warmup_iters=0 --lr_decay_iters=6"
README_RUN = [
    ("python data/shakespeare_char/prepare.py", f"--input={CORPUS}"),
    ("python train.py config/train_shakespeare_char_cpu.py", SMALL),
    ("python sample.py --out_dir=out-shakespeare-char-cpu --num_samples=1 --max_new_tokens=500", "--max_new_tokens=20"),
    ("python train.py config/train_shakespeare_char_cpu.py --max_iters=500 --out_dir=out-500", SMALL),
    ("python train.py config/train_shakespeare_char_cpu.py config/modern.py --out_dir=out-modern", SMALL),
    ("python sample.py --out_dir=out-shakespeare-char-cpu --start=\"ROMEO:\" --num_samples=3 --max_new_tokens=300",
     "--max_new_tokens=20"),
    ("python eval.py --out_dir=out-shakespeare-char-cpu", "--batch_size=64"),
    ("python plot.py out-shakespeare-char-cpu", ""),
]


@pytest.mark.slow
def test_the_readme_runs_in_order_without_replacing_a_result(tmp_path):
    """In a copy of the tracked files: each README command, scaled down, exits 0; the quick start's
    checkpoint is the same file after the commands that follow it."""
    if not CORPUS.is_file():
        pytest.skip(NO_SHAKESPEARE)
    readme = (REPO_ROOT / "README.md").read_text()
    for command, _ in README_RUN:
        assert command in readme, f"the README no longer holds: {command}"
    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    for name in files.split():
        if name.endswith((".py", ".json")) or name.startswith("config/"):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO_ROOT / name, tmp_path / name)
    quick = None
    for command, extra in README_RUN:
        argv = shlex.split(command)[1:] + shlex.split(extra)
        result = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                                env=os.environ | ONE_THREAD_ENV)
        assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}"
        ckpt = tmp_path / "out-shakespeare-char-cpu" / "ckpt.pt"
        if quick is None and ckpt.exists():
            quick = ckpt.read_bytes()
    assert (tmp_path / "out-shakespeare-char-cpu" / "ckpt.pt").read_bytes() == quick
    assert (tmp_path / "out-shakespeare-char-cpu" / "loss.png").is_file()
