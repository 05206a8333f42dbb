"""requirements-lock.txt and scripts/lock.py: the lock names every requirement, and the helpers read it.

    python -m pytest tests/test_lock.py
"""
import importlib.util
import re

from tests.helpers import REPO_ROOT

spec = importlib.util.spec_from_file_location("lock", REPO_ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def requirement_names(path) -> set[str]:
    """Top-level names of a requirements file, following -r includes."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            names |= requirement_names(path.parent / line[2:].strip())
        elif line:
            names.add(lock.canonical(re.split(r"[<>=!~;\[ ]", line, 1)[0]))
    return names


def test_the_lock_pins_every_requirement_and_torch_without_a_build_label():
    """A dependency added to requirements.txt without refreshing the lock would install unpinned."""
    pins = lock.parse(lock.LOCK.read_text())
    missing = requirement_names(REPO_ROOT / "requirements-dev.txt") - pins.keys()
    assert not missing, f"not in requirements-lock.txt: {missing}; run python scripts/lock.py upgrade --write"
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins["torch"])  # '+cpu' would refuse a CUDA build


def test_render_parse_round_trip_and_the_change_lines():
    old = {"pytest": "9.0.3", "numpy": "2.4.6", "gone": "1.0"}
    new = {"pytest": "9.2.0", "numpy": "2.4.6", "fresh": "0.1"}
    assert lock.parse(lock.render(new)) == new
    assert lock.changes(old, new) == ["+ fresh 0.1", "- gone 1.0", "  pytest 9.0.3 -> 9.2.0"]
    assert lock.canonical("Typing_Extensions") == lock.canonical("typing-extensions") == "typing-extensions"
