"""The version lock: requirements-lock.txt pins every package that `requirements-dev.txt` installs.

    python scripts/lock.py upgrade            # newest versions into a scratch venv, run the suite there,
                                              # print what changed and whether the suite passed
    python scripts/lock.py upgrade --write    # the same, and write the lock if the suite passed
    python scripts/lock.py upgrade --no-tests --write   # re-resolve only (after adding a dependency)
    python scripts/lock.py check              # does this environment hold exactly the lock? (CI)

Why a pip constraints file, why torch is pinned without its local build label (+cpu, +cu128), and why the
upgrade keeps torch at the locked version: docs/reliability.md, "The version lock".
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements-lock.txt"
HEADER = """\
# Every package `pip install torch==2.13.0 -r requirements-dev.txt` installs, at the versions the test suite
# passed with (docs/reliability.md#the-version-lock). A pip constraints file: use it with -c, beside -r:
#     pip install torch==2.13.0 -r requirements-dev.txt -c requirements-lock.txt
# Written by `python scripts/lock.py upgrade --write`; edit requirements.txt, not this file.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> dict[str, str]:
    """'name==version' lines -> {canonical name: version}; comments and blank lines skipped."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise SystemExit(f"error: {LOCK.name}: '{line}' is not a name==version pin")
            pins[canonical(name)] = version.strip()
    return pins


def frozen(python: str) -> dict[str, str]:
    """What `python`'s environment holds, from pip freeze, torch's local build label dropped."""
    out = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    pins = parse("\n".join(line for line in out.splitlines() if "==" in line))
    for tool in ("pip", "setuptools", "wheel"):  # the venv's own installers, not the project's closure
        pins.pop(tool, None)
    if "torch" in pins:
        pins["torch"] = pins["torch"].split("+", 1)[0]
    return pins


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package that differs: 'name old -> new', '+ name new' (added), '- name old' (gone)."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            lines.append(f"- {name} {old[name]}")
        elif name not in old:
            lines.append(f"+ {name} {new[name]}")
        elif old[name] != new[name]:
            lines.append(f"  {name} {old[name]} -> {new[name]}")
    return lines


def upgrade(write: bool, run_tests: bool, pytest_args: list[str]) -> int:
    old = parse(LOCK.read_text()) if LOCK.exists() else {}
    torch = f"torch=={old['torch']}" if "torch" in old else "torch"
    scratch = Path(tempfile.mkdtemp(prefix="lock-upgrade-"))
    print(f"scratch venv: {scratch}", flush=True)
    venv.create(scratch, with_pip=True)
    python = str(scratch / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", torch, "-r", str(ROOT / "requirements-dev.txt")], check=True)
    new = frozen(python)
    diff = changes(old, new)
    print(f"{len(diff)} package(s) changed against {LOCK.name}:" if diff else f"no change against {LOCK.name}")
    print("\n".join(diff))
    before = LOCK.read_text() if LOCK.exists() else None
    LOCK.write_text(render(new))  # the suite checks the lock it would keep (tests/test_lock.py)
    passed = True
    try:
        if run_tests:
            rc = subprocess.run([python, "-m", "pytest", *pytest_args], cwd=ROOT).returncode
            passed = rc == 0
            print(f"suite on the newest versions: {'passed' if passed else f'FAILED (pytest exit {rc})'}")
    finally:
        if not (write and passed) and before is not None:
            LOCK.write_text(before)
    if write and passed:
        print(f"wrote {LOCK.name} ({len(new)} packages)")
    elif write:
        print(f"{LOCK.name} left as it was: fix what the newest versions break, then run this again")
    return 0 if passed else 1


def check() -> int:
    """This interpreter's environment against the lock: every locked package at its version, and nothing
    installed that the lock does not name (a stale lock, or a package left on the machine by hand)."""
    locked, have = parse(LOCK.read_text()), frozen(sys.executable)
    wrong = [f"{n} {have[n]} (locked {v})" for n, v in locked.items() if n in have and have[n] != v]
    missing, extra = sorted(locked.keys() - have.keys()), sorted(have.keys() - locked.keys())
    for label, names in (("not the locked version", wrong), ("locked but not installed", missing),
                         ("installed but not in the lock", extra)):
        if names:
            print(f"error: {label}: {', '.join(names)}; "
                  f"install with -c {LOCK.name}, or refresh it: python scripts/lock.py upgrade --write")
    if wrong or missing or extra:
        return 2
    print(f"environment matches {LOCK.name} ({len(locked)} packages)")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upgrade", help="newest versions in a scratch venv, the suite there, the changes")
    up.add_argument("--write", action="store_true", help="write the lock if the suite passed")
    up.add_argument("--no-tests", action="store_true", help="re-resolve only")
    up.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    sub.add_parser("check", help="this environment holds exactly the lock")
    args = parser.parse_args(argv)
    return check() if args.command == "check" else upgrade(args.write, not args.no_tests, args.pytest_args)


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1:]))
