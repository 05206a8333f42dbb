"""The decode levers at batch 1, measured side by side: one shape's cached step (benchmarks/bandwidth.py's
SHAPES) in float32, int8, and bfloat16 with the Blocks' matrices packed for oneDNN or not and the head copy laid out
two ways, alternated round by round in one process, so that a busy machine slows
them all alike (docs/performance.md, "Decoding against the bandwidth bound"). The CPU's levers: on another
device the section is skipped.

    python bench.py --sections=levers --threads=1                       # GPT-2 small's shape, 5 rounds
    python bench.py --sections=levers --levers_shape=quickstart --levers_rounds=3 --threads=2
    python bench.py --sections=levers --threads=1 --levers_profile=True --levers_rounds=1  # also each variant's ops

Variants: "int8" is --quantize=int8's model (core/decoding/quantize.py; with --levers_profile, where the time its
products leave goes); "unpacked" is the bfloat16 model without cpu.pack_linears, through oneDNN's matmul at one row
or torch's own GEMV (cpu.one_row_kernels, which also serves the matrices too small to pack); "head copy (vocab, C)"
reads the float32 head copy laid out untransposed. Levers dropped: docs/lab-notes.md. The bound is bandwidth.bound_s
at the fastest copy of all rounds. Needs a CPU with native bfloat16 for the bf16 rows.
"""
import contextlib
import dataclasses
import statistics

import torch

from benchmarks import bandwidth
from benchmarks.common import at_least
from core import cpu, runtime
from core.decoding.decode import keep_float32_head
from core.errors import UserError
from model import GPT


@dataclasses.dataclass
class Settings:
    levers_shape: str = "gpt2"      # one of benchmarks/bandwidth.py's SHAPES
    levers_rounds: int = 5          # each round: one copy, then every variant's median of levers_steps cached steps
    levers_steps: int = 20
    levers_profile: bool = False    # also each variant's ops over levers_steps cached steps (torch.profiler)


IN_DEFAULT_RUN = False  # minutes at GPT-2 small's shape: only when --sections names it


def check(cfg) -> None:
    if cfg.levers_shape not in bandwidth.SHAPES:
        raise UserError(f"levers_shape: unknown '{cfg.levers_shape}'; use one of {', '.join(bandwidth.SHAPES)}")
    at_least(cfg, 1, "levers_rounds", "levers_steps")


def unavailable(rt: runtime.Runtime) -> str | None:
    return None if rt.device_type == "cpu" else "the decode levers are the CPU's: run it with --device=cpu"


def with_vocab_by_c_head(model: GPT) -> GPT:
    """The float32 head copy as the head is laid out, (vocab, C), read as F.linear reads it (decode.Float32Head
    keeps it transposed, (C, vocab))."""
    model.lm_head.weight_t = model.lm_head.weight_t.t().contiguous().t()  # (C, vocab), strides (1, C)
    return model


def variants(config) -> dict[str, tuple[GPT, bool]]:
    """name: (model, whether oneDNN takes the unpacked matrices at one row); every model from the same weights."""
    def build(precision, pack=True):
        if pack:
            return bandwidth.decoding_model(config, runtime.Runtime("cpu", "cpu", "float32"), precision)
        torch.manual_seed(0)
        model = GPT(config).eval().to(dtype=runtime.DTYPES[precision])  # as inference_model, but for the packing
        keep_float32_head(model)
        return model
    as_decoding = False  # model.py's kernel choice
    out = {"float32": (build("float32"), as_decoding), "int8": (build("int8"), as_decoding)}
    if cpu.cpu_native_bf16():
        plain, packed = build("bfloat16", pack=False), build("bfloat16")
        out |= {"bf16 unpacked, oneDNN": (plain, True),
                "bf16 unpacked, torch's GEMV (oneDNN off)": (plain, as_decoding),
                "bf16 packed (as decoding now)": (packed, as_decoding),
                "bf16 packed, head copy (vocab, C)": (with_vocab_by_c_head(build("bfloat16")), as_decoding)}
    return out


@contextlib.contextmanager
def kernels(onednn: bool):
    """The kernel choice for the block: if onednn, oneDNN for the unpacked matmuls at one row too
    (cpu.one_row_kernels made a no-op), else model.py's own choice (torch's GEMV at one row); packed
    matrices call oneDNN either way."""
    choice = cpu.one_row_kernels
    if onednn:
        cpu.one_row_kernels = lambda x: contextlib.nullcontext()
    try:
        yield
    finally:
        cpu.one_row_kernels = choice


@torch.no_grad()
def profile_table(model: GPT, context: int, steps: int) -> str:
    """torch.profiler over `steps` cached steps (the prefill before it): each op with its input shapes and
    its self time per step. The profiler's op times are wall times: on a busy machine they include waits."""
    step = bandwidth.cached_step(model, context)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    lines = ["| op | input shapes | calls per step | ms per step | share |", "|---|---|---:|---:|---:|"]
    lines += [f"| {e.key} | {str(e.input_shapes)[:70]} | {e.count / steps:.0f} | "
              f"{e.self_cpu_time_total / 1e3 / steps:.2f} | {e.self_cpu_time_total / total:.0%} |" for e in ops[:12]]
    return "\n".join(lines)


def measure(cfg, rt: runtime.Runtime) -> dict:
    name, config, context = bandwidth.SHAPES[cfg.levers_shape]
    models = variants(config)
    steps, copies = {k: [] for k in models}, []
    for _ in range(cfg.levers_rounds):
        copies.append(bandwidth.copy_bandwidth(repeats=5))
        for key, (model, on) in models.items():
            with kernels(on):
                steps[key].append(bandwidth.step_times(bandwidth.cached_step(model, context), repeats=cfg.levers_steps))
    profiles = {}
    if cfg.levers_profile:
        for key, (model, on) in models.items():
            with kernels(on):
                profiles[key] = profile_table(model, context, cfg.levers_steps)
    rows = []
    for key, (model, _) in models.items():
        kv = bandwidth.kv_cache_bytes(config, context, model.transformer.wte.weight.element_size())
        wall, cpu_s = (statistics.median(s[i] for s in steps[key]) for i in (0, 1))
        rows.append({"variant": key, "step_ms": wall * 1e3, "step_cpu_ms": cpu_s * 1e3,
                     "bound_ms": bandwidth.bound_s(bandwidth.decode_weight_bytes(model), kv, max(copies)) * 1e3})
    return {"shape": name, "context": context, "threads": torch.get_num_threads(), "rounds": cfg.levers_rounds,
            "steps": cfg.levers_steps, "copy_best": max(copies), "copy_worst": min(copies),
            "profiles": profiles, "rows": rows}


def table(r: dict) -> str:
    lines = [f"\n{key}: the ops of {r['steps']} cached steps\n\n{text}" for key, text in r["profiles"].items()]
    lines += [f"{r['shape']}, context {r['context']}, {r['threads']} thread(s), {r['rounds']} rounds; copy "
              f"{r['copy_best'] / 1e9:.1f} GB/s at best, {r['copy_worst'] / 1e9:.1f} at worst\n",
              "| variant | step ms | step CPU ms | bound ms | step / bound |\n|---|---:|---:|---:|---:|"]
    lines += [f"| {x['variant']} | {x['step_ms']:.2f} | {x['step_cpu_ms']:.2f} | {x['bound_ms']:.2f} | "
              f"{x['step_ms'] / x['bound_ms']:.2f}x |" for x in r["rows"]]
    return "\n".join(lines)
