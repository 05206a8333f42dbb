"""What every section shares: timing (medians after untimed warm-up), peak memory above a baseline, out-of-memory
as a figure, the torch thread count for a while, the settings' checks, and the tables (also compare_recipe.py's) and
their number formats.
"""
import contextlib
import dataclasses
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from core import runtime
from core.config import parse_args
from core.errors import UserError
from core.training.train_config import TrainConfig
from model import GPTConfig

OOM = "OOM"  # a figure that did not fit in device memory
MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent  # the repository: train.py and serve.py run from here
DEFAULT_CORPUS = "../shared/data/tinyshakespeare.txt"
GENERATED_CHARS = 1_000_000  # the stand-in corpus when DEFAULT_CORPUS is absent: about Tiny Shakespeare's size


def median_time(fn: Callable[[], object], warmup: int, repeats: int,
                synchronize: Callable[[], None] = lambda: None) -> float:
    """Median seconds of `repeats` calls of fn, after `warmup` untimed calls; synchronize waits for queued device work,
    so each time covers the work fn launched, not just the launching."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_peak_extra_bytes(runs: dict[str, Callable[[], object]]) -> dict[str, int]:
    """For each named run: peak CPU memory allocated while it runs, above its start: the running sum, in time order,
    of the "[memory]" events torch.profiler(profile_memory=True) records from torch's CPU allocator (scratch buffers
    included), each run in a record_function window of one profile. The per-op summaries lose the order of events,
    so this reads the raw event list."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, fn in runs.items():
            with torch.profiler.record_function(name):
                fn()
    events = prof.profiler.kineto_results.events()
    windows = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in runs}
    allocs = sorted(((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"), key=lambda m: m[0])
    # each window's running total of its own events, from 0 where it starts: its highest point
    return {name: max(itertools.accumulate((n for t, n in allocs if start <= t <= end), initial=0))
            for name, (start, end) in windows.items()}


def or_oom(fn: Callable[[], object], rt: runtime.Runtime, oom: object = OOM):
    """fn(), or `oom` (a figure: OOM; a row: its keys and an error) when it runs out of device memory: one figure
    lost, not the whole run."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()
        return oom


def cuda_peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated while fn runs, above what was allocated when it started (bytes)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def peak_extra_bytes(runs: dict[str, Callable[[], object]], rt: runtime.Runtime) -> tuple[dict, str]:
    """Each run's peak bytes above its start (OOM where it ran out), and how they were measured."""
    if rt.device_type == "cuda":
        return ({name: or_oom(lambda: cuda_peak_extra_bytes(run), rt) for name, run in runs.items()},
                "torch.cuda.max_memory_allocated above memory_allocated before the call")
    if rt.device_type != "cpu":
        raise UserError(f"peak memory is measured on cuda or cpu, not {rt.device_type}; "
                        f"leave attention and memory out of --sections there")
    out_of_memory = set()

    def guarded(name: str, run: Callable[[], object]) -> Callable[[], None]:
        return lambda: or_oom(run, rt) == OOM and out_of_memory.add(name)
    peaks = cpu_peak_extra_bytes({name: guarded(name, run) for name, run in runs.items()})
    return (peaks | {name: OOM for name in out_of_memory},
            "torch.profiler(profile_memory=True): the CPU allocator's alloc/free events summed in time order")


@contextlib.contextmanager
def num_threads(n: int):
    """torch's thread count set to n for the with block, and back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def merged_config(name: str, general: type, sections: dict, module: str) -> type:
    """One config dataclass: general's fields, then each section module's Settings in the sections' order.
    Every flag has one owner: a name two of them declare stops at import."""
    owners, fields = {}, []
    settings = [(name, m.Settings) for name, m in sections.items() if hasattr(m, "Settings")]
    for owner, cls in [("bench.py", general)] + settings:
        for f in dataclasses.fields(cls):
            if f.name in owners:
                raise TypeError(f"the {owner} section's setting {f.name} is the {owners[f.name]} section's already")
            owners[f.name] = owner
            fields.append((f.name, f.type, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(name, fields, namespace={"__module__": module})


def merged_presets(general: dict[str, dict], sections: dict) -> dict[str, dict]:
    """Each preset's general values and every section's part of it (a module's PRESETS)."""
    presets = {name: dict(values) for name, values in general.items()}
    for module in sections.values():
        for name, values in getattr(module, "PRESETS", {}).items():
            presets[name] |= values
    return presets


def int_list(text: str, key: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{key} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise UserError(f"{key} must list positive integers, got '{text}'")
    return values


def spec_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def some_of(text: str, allowed, key: str) -> list[str]:
    """The comma-separated names in text, each one of allowed."""
    names = spec_list(text)
    unknown = set(names) - set(allowed)
    if unknown:
        raise UserError(f"{key}: unknown {', '.join(sorted(unknown))}; use some of {','.join(allowed)}")
    return names


def gpt_config(cfg, prefix: str = "", **fixed) -> GPTConfig:
    """The model of a section's <prefix>n_layer, n_head, n_embd, block_size and vocab_size settings (those `fixed`
    does not give), without dropout."""
    shape = {k: getattr(cfg, prefix + k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
             if k not in fixed}
    if shape["n_embd"] % shape["n_head"]:
        raise UserError(f"{prefix}n_embd ({shape['n_embd']}) must be divisible by {prefix}n_head ({shape['n_head']})")
    return GPTConfig(dropout=0.0, **shape, **fixed)


def read_recipe(specs: Sequence[str], source: str) -> TrainConfig:
    """train.py's config from config files and key=value pairs, applied in order as train.py applies them.
    The sections train what it says (model, batch, optimizer, schedule); its I/O and device keys are not used."""
    try:
        return parse_args(TrainConfig, [f"--{spec}" if "=" in spec else spec for spec in specs])
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def generated_text(n_chars: int, seed: int = 0) -> str:
    """A deterministic stand-in corpus: lines of pseudo-words with a Zipf-like frequency."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlcumwfgypbvkjxqz") for _ in range(rng.randint(1, 9))) for _ in range(5000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]
    lines, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choices(words, weights, k=rng.randint(3, 14))).capitalize() + rng.choice(".,;?!") + "\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)[:n_chars]


def model_text(c: GPTConfig, batch_size: int) -> str:
    return (f"{c.n_layer} layers, {c.n_embd} wide, {c.n_head} heads, block_size {c.block_size}, "
            f"vocab {c.vocab_size}, batch {batch_size}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded so that the table also lines up in a terminal."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"  # right-aligned columns
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def mib(n: float | str) -> str:
    return OOM if n == OOM else f"{n / MiB:,.1f} MiB" if n >= MiB / 10 else f"{n / 1024:,.1f} KiB"


def num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"
