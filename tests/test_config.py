"""Configuration: defaults, config files, --key=value, and the loud errors.

    python -m pytest tests/test_config.py
"""
import dataclasses
import json

import pytest

from core.config import from_dict, parse_args, parse_cli_value, to_dict
from core.errors import UserError


@dataclasses.dataclass
class Cfg:
    name: str = "x"
    steps: int = 10
    lr: float = 1e-3
    flag: bool = False
    maybe: int | None = None
    path: str | None = None

    def validate(self):
        if self.steps < 0:
            raise UserError("steps must not be negative")


def test_defaults_then_file_then_command_line(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import math\nsteps = 4 * 5  # arithmetic is fine\nlr = 3e-4\n_private = 1\n")
    cfg = parse_args(Cfg, [str(f), "--steps=7"])
    assert (cfg.steps, cfg.lr, cfg.name) == (7, 3e-4, "x")


def test_int_where_float_expected_and_booleans():
    cfg = parse_args(Cfg, ["--lr=1", "--flag=True"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.flag is True
    assert parse_args(Cfg, ["--flag=false"]).flag is False


def test_values_with_equals_and_strings():
    cfg = parse_args(Cfg, ["--name=a=b", "--path=out/x"])
    assert cfg.name == "a=b" and cfg.path == "out/x"
    assert parse_args(Cfg, ["--name='1'"]).name == "1"
    assert parse_args(Cfg, ["--name=123"]).name == "123"  # a str field keeps the text


def test_optional_fields():
    assert parse_args(Cfg, ["--maybe=3"]).maybe == 3
    assert parse_args(Cfg, ["--maybe=None"]).maybe is None


@pytest.mark.parametrize("argv, words", [
    (["--stepz=3"], ["unknown config key 'stepz'", "command line", "did you mean 'steps'"]),
    (["--steps=1.5"], ["'steps'", "expects int", "1.5"]),
    (["--steps=abc"], ["'steps'", "expects int", "'abc'"]),
    (["--flag=1"], ["'flag'", "expects bool"]),
    (["--lr=fast"], ["'lr'", "expects float"]),
    (["--steps"], ["expected --steps=VALUE"]),
    (["--steps=-1"], ["steps must not be negative"]),
    (["missing_config.py"], ["config file 'missing_config.py' not found"]),
])
def test_errors_name_the_key(argv, words):
    with pytest.raises(UserError) as e:
        parse_args(Cfg, argv)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("learning_rat = 1e-3\n")
    with pytest.raises(UserError, match=r"unknown config key 'learning_rat' \(in .*c.py\)"):
        parse_args(Cfg, [str(f)])


def test_a_failing_config_file_is_one_line(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("steps = 1 / 0\n")
    with pytest.raises(UserError, match="failed to run: ZeroDivisionError"):
        parse_args(Cfg, [str(f)])


def test_command_line_values_are_literals_never_evaluated():
    # An expression is not run: it is not a literal, so it fails the type check.
    with pytest.raises(UserError, match="expects int"):
        parse_args(Cfg, ["--steps=__import__('os').getpid()"])
    assert parse_cli_value("__import__('os')", str) == "__import__('os')"


def test_round_trip_through_json():
    cfg = parse_args(Cfg, ["--steps=3", "--maybe=2"])
    assert from_dict(Cfg, json.loads(json.dumps(to_dict(cfg))), "test") == cfg
