"""Typed configuration: dataclass defaults, overridden by config files, then by --key=value.

Config files (config/*.py) are the user's own Python programs, run with full power like any script you run; each
top-level name they assign not starting with an underscore is an override. Command-line values are parsed as Python
literals (ast.literal_eval), never evaluated. An unknown key or a wrong type is one line naming the key and the
closest valid ones. RENAMED ({name: (its key, value -> its value)}): other projects' names, e.g. nanoGPT's dataset.
"""
import ast
import contextlib
import dataclasses
import difflib
import inspect
import io
import runpy
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

from core.errors import UserError

T = TypeVar("T")


def _type_name(tp) -> str:
    inner = _optional_inner(tp)
    return getattr(tp, "__name__", str(tp)) if inner is None else f"{_type_name(inner)} or None"


def _optional_inner(tp):
    """X for `X | None` / Optional[X], else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def coerce(key: str, value: Any, tp, source: str) -> Any:
    """Check `value` against the field type `tp`; an int is accepted where a float is expected."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else coerce(key, value, inner, source)
    ok = ((tp is bool and isinstance(value, bool))
          or (tp is int and isinstance(value, int) and not isinstance(value, bool))
          or (tp is float and isinstance(value, (int, float)) and not isinstance(value, bool))
          or (tp is str and isinstance(value, str)))
    if not ok:
        raise UserError(f"config key '{key}' expects {_type_name(tp)}, got {value!r} ({source})")
    return float(value) if tp is float else value


def parse_cli_value(raw: str, tp) -> Any:
    base = _optional_inner(tp) or tp
    if raw == "None" and base is not tp:
        return None
    if base is bool and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if base is str:  # a bare word is a string; a quoted one is taken as the literal it spells
        quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
        return ast.literal_eval(raw) if quoted else raw
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # coerce() then names the key, the value and the type


def _unknown_key(key: str, valid: Sequence[str], source: str) -> UserError:
    close = [f"'{k}'" for k in difflib.get_close_matches(key, valid, n=5)]
    hint = (f"did you mean {close[0]}?" if len(close) == 1 else f"did you mean one of {', '.join(close)}?" if close
            else "--help lists every key")
    return UserError(f"unknown config key '{key}' ({source}); {hint}")


def read_config_file(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise UserError(f"config file '{path}' not found; pass a path such as config/train_shakespeare_char.py")
    try:
        names = runpy.run_path(path)
    except Exception as e:  # the user's own file failed: say where, keep it one line
        raise UserError(f"config file '{path}' failed to run: {type(e).__name__}: {e}") from None
    return {k: v for k, v in names.items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def apply_overrides(cfg: T, overrides: dict[str, Any], source: str) -> T:
    """cfg with overrides (a config file's, a run's saved config, a preset) applied, each key and type checked."""
    hints = typing.get_type_hints(type(cfg))
    valid = [f.name for f in dataclasses.fields(cfg)]
    renamed = getattr(cfg, "RENAMED", {})
    changes = {}
    for key, value in overrides.items():
        if key in renamed:  # another project's name for a key (a str), e.g. nanoGPT's dataset for data_dir
            ours, convert = renamed[key]
            new = convert(coerce(key, value, str, source))
            print(f"note: {key}={value!r} ({source}) is {ours}={new!r} here", file=sys.stderr)
            key, value = ours, new
        if key not in hints:
            raise _unknown_key(key, valid, source)
        changes[key] = coerce(key, value, hints[key], source)
    return dataclasses.replace(cfg, **changes)


def config_help(cls) -> str:
    """Every key: its default, its type and allowed values, and its one-line description (field_help)."""
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    lines = ["options (config files and --key=value override these defaults):"]
    for f in dataclasses.fields(cls):
        base = _optional_inner(hints[f.name]) or hints[f.name]
        allowed = f.metadata.get("choices") or ((True, False) if base is bool else ())
        kind = _type_name(hints[f.name]) + (f": {' | '.join(map(str, allowed))}" if allowed else "")
        lines.append(f"  --{f.name}={f.default!r}  ({kind})" + (f"  {helps[f.name]}" if helps.get(f.name) else ""))
    for name, (ours, convert) in getattr(cls, "RENAMED", {}).items():
        lines.append(f"  --{name}=X  (str)  another name: {ours}={convert('X')!r}")
    return "\n".join(lines)


def field_help(cls) -> dict[str, str]:
    """Each field's --help text, whose one home is the comment after it in its dataclass's source (comment-only lines
    indented under it continue it), or, for a field made in code, its metadata["help"]."""
    helps = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            with contextlib.suppress(OSError, TypeError):  # made by dataclasses.make_dataclass: no source
                helps |= _source_comments(textwrap.dedent(inspect.getsource(klass)))
    return helps | {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if "help" in f.metadata}


def _source_comments(source: str) -> dict[str, str]:
    """{field: its comment} of a class's source: `name: type = default  # comment` and continuation lines."""
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    found = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)) or node.end_lineno not in comments:
            continue
        text, end = [comments[node.end_lineno]], body[i + 1].lineno if i + 1 < len(body) else len(lines) + 1
        for number in range(node.end_lineno + 1, end):
            line = lines[number - 1]
            if number not in comments or not line.lstrip().startswith("#") or \
                    len(line) - len(line.lstrip()) <= node.col_offset:  # a section comment, not a continuation
                break
            text.append(comments[number])
        found[node.target.id] = " ".join(text)
    return found


def parse_args(cls: type[T], argv: Sequence[str], base: T | None = None, validate: bool = True) -> T:
    """Build a `cls` config: defaults (or `base`), then each config file in order, then each --key=value.
    validate=False leaves cls.validate() to a later call (a first pass that only reads a key or two)."""
    cfg = cls() if base is None else base
    hints = typing.get_type_hints(cls) | {key: str for key in getattr(cls, "RENAMED", {})}
    for arg in argv:
        if arg in ("-h", "--help"):
            print(config_help(cls))
            sys.exit(0)
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq and hints.get(key) in (bool, bool | None):
                raw = "True"  # a bare --flag switches a bool on
            elif not eq:
                raise UserError(f"expected --{key}=VALUE, got '{arg}'")
            if key not in hints:
                raise _unknown_key(key, list(hints), "command line")
            cfg = apply_overrides(cfg, {key: parse_cli_value(raw, hints[key])}, "command line")
        else:
            cfg = apply_overrides(cfg, read_config_file(arg), f"in {arg}")
    if validate and hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def at_least(cfg, low, *keys: str) -> None:
    """The one check of settings that count: a UserError naming the first of keys below low (None: unset, allowed)."""
    for key in keys:
        if (value := getattr(cfg, key)) is not None and value < low:
            raise UserError(f"config key '{key}' must be at least {low}, got {value}")
