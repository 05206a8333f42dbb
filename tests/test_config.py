"""Configuration: defaults, config files, --key=value, and the loud errors.

    python -m pytest tests/test_config.py
"""
import dataclasses
import json

import pytest

from core.config import apply_overrides, parse_args, parse_cli_value
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


def test_validate_false_leaves_the_check_to_a_later_call():
    assert parse_args(Cfg, ["--steps=-1"], validate=False).steps == -1  # a first pass that reads a key or two
    no_check = dataclasses.make_dataclass("NoCheck", [("steps", int, 0)])  # a config without validate()
    assert parse_args(no_check, ["--steps=-1"]).steps == -1


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
    assert apply_overrides(Cfg(), json.loads(json.dumps(dataclasses.asdict(cfg))), "test") == cfg


# --- train.py's model keys are GPTConfig's fields ------------------------------------------------

# A value other than the default for a GPTConfig field whose type alone does not give a valid one.
OTHER_VALUES: dict = {"qkv_bias": True, "value_embeds": 1}


def other_value(field: dataclasses.Field):
    """A valid value for `field` other than its default, from its type (or OTHER_VALUES)."""
    from model import CHOICES

    if field.name in OTHER_VALUES:
        return OTHER_VALUES[field.name]
    if field.name in CHOICES:
        return next(v for v in CHOICES[field.name] if v != field.default)
    if isinstance(field.default, bool):
        return not field.default
    if isinstance(field.default, (int, float)):
        return field.default * 2 if field.default else 0.5
    return {int | None: 2, float | None: 2.0}[field.type]  # None by default: n_kv_head, logit_softcap, mlp_hidden


def test_every_gpt_config_field_is_a_train_config_key_with_its_default():
    """A field added to GPTConfig is a key of train.py's config with nothing else to edit; vocab_size's
    None there means the dataset's vocabulary."""
    from core.training.train_config import TrainConfig
    from model import GPTConfig

    keys = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(GPTConfig):
        assert f.name in keys, f"GPTConfig.{f.name} cannot be set from a config file"
        assert keys[f.name].type == (int | None if f.name == "vocab_size" else f.type), f.name
        assert keys[f.name].default == (None if f.name == "vocab_size" else f.default), f.name


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(__import__("model").GPTConfig)
                                  if f.name != "vocab_size"])
def test_every_gpt_config_field_set_on_the_command_line_reaches_the_model(name):
    import train
    from core.training.train_config import TrainConfig
    from model import GPTConfig

    field = next(f for f in dataclasses.fields(GPTConfig) if f.name == name)
    value = other_value(field)
    cfg = parse_args(TrainConfig, [f"--{name}={value if isinstance(value, str) else repr(value)}"])
    config = train.scratch_config(cfg, {"vocab_size": 65})  # what init_from=scratch builds
    assert getattr(config, name) == value != field.default
    assert dataclasses.asdict(cfg)[name] == value  # and out_dir/config.json records it


def test_a_config_file_sets_the_norm_epsilon_mlp_width_and_gelu(tmp_path):
    import train
    from core.training.train_config import TrainConfig

    f = tmp_path / "c.py"
    f.write_text("norm_eps = 1e-6\nmlp_hidden = 100\ngelu_approximate = 'none'\n")
    config = train.scratch_config(parse_args(TrainConfig, [str(f)]), {"vocab_size": 65})
    assert (config.norm_eps, config.mlp_hidden, config.gelu_approximate) == (1e-6, 100, "none")


# --- help from the fields' own comments -------------------------------------------------------------

@dataclasses.dataclass
class Commented:
    plain: int = 1
    # a section comment, not a description
    described: str = "a"  # one line
    long: float = 2.0     # a first line,
                          # and its continuation
    flag: bool = False


def test_help_is_each_fields_own_comment_with_its_allowed_values():
    from core.config import config_help, field_help

    assert field_help(Commented) == {"described": "one line", "long": "a first line, and its continuation"}
    text = config_help(Commented)
    assert "  --plain=1  (int)\n" in text and "  --long=2.0  (float)  a first line, and its continuation" in text
    assert "  --flag=False  (bool: True | False)" in text and "section comment" not in text


def test_train_help_describes_every_commented_key_with_its_values():
    """train.py --help: TrainConfig's keys with their comments, the model keys with GPTConfig's own comments and
    the allowed values GPTConfig checks (model.CHOICES): no second list."""
    import inspect
    import re

    import model
    from core.config import config_help
    from core.training.train_config import TrainConfig

    text = config_help(TrainConfig)
    source = inspect.getsource(model.GPTConfig)
    for name, values in model.CHOICES.items():
        comment = re.search(rf"^\s+{name}: [^#]*# (.*)$", source, re.M).group(1)
        assert f"(str: {' | '.join(values)})  {comment}" in text, name
    assert "--max_iters=600000  (int)  iterations in all" in text
    assert ("--init_from='scratch'  (str)  'scratch', 'resume', 'auto' (resume if out_dir holds a checkpoint, else "
            "scratch), a base run's out_dir (its weights, a new run), a GPT-2 name") in text
    described = [line for line in text.splitlines()[1:] if re.match(r"  --\w+=\S+  \([^)]*\)  \S", line)]
    assert len(described) >= len(dataclasses.fields(TrainConfig)) - 6, text  # n_layer, n_head, n_embd, dropout, ...


# --- the keys train.py and rl.py share ----------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["--max_iters=0"], "config key 'max_iters' must be at least 1, got 0"),
    (["--grad_clip=-1"], "config key 'grad_clip' must be at least 0, got -1.0"),
    (["--learning_rate=1e999"], "need 0 < learning_rate < inf, got inf"),
    (["--min_lr=1"], "need 0 <= min_lr <= learning_rate"),
    (["--beta2=1"], "need 0 <= beta1, beta2 < 1"),
    (["--dist_timeout_s=0"], "dist_timeout_s must be positive"),
])
def test_train_and_rl_check_their_shared_keys_alike(argv, fragment):
    """RunConfig's keys are train.py's and rl.py's, each described in both --help; a bad value of one is the same
    line in both."""
    import re

    import rl
    from core.config import config_help, field_help
    from core.training.train_config import RunConfig, TrainConfig

    for cls in (TrainConfig, rl.RLConfig):
        helps, text = field_help(cls), config_help(cls)
        for f in dataclasses.fields(RunConfig):
            assert helps.get(f.name) and f"  --{f.name}=" in text and helps[f.name] in text, (cls.__name__, f.name)
        with pytest.raises(UserError, match=re.escape(fragment)):
            parse_args(cls, argv)


def test_rl_refuses_init_from_auto(tmp_path):
    """init_from=auto (resume, else scratch) is train.py's: rl.py never starts from scratch."""
    import rl
    from core.training import loop

    with pytest.raises(UserError, match="unknown init_from 'auto'; use resume"):
        loop.parse_config(rl.RLConfig, ["--init_from=auto", f"--out_dir={tmp_path}"])
