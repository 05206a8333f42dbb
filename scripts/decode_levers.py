"""The decode levers at batch 1, measured side by side: one shape's cached step (benchmarks/bandwidth.py's
SHAPES) in float32 and in bfloat16 with the Blocks' matrices packed for oneDNN or not, each attention
kernel, and with a bfloat16 head, alternated round by round in one process, so that a busy machine slows
them all alike (docs/performance.md, "Decoding against the bandwidth bound").

    python scripts/decode_levers.py                           # GPT-2 small's shape, 5 rounds, one thread
    python scripts/decode_levers.py --shape=quickstart --rounds=3 --threads=2
    python scripts/decode_levers.py --compile                 # also torch.compile's float32 step (minutes)
    python scripts/decode_levers.py --profile --rounds=1      # also each variant's ops (torch.profiler)

Variants: "unpacked" is the bfloat16 model without cpu.pack_linears, through oneDNN's matmul at one row
or torch's own GEMV (cpu.one_row_kernels, which also serves the matrices too small to pack); "math
backend for one query" runs attention through SDPA's math backend instead of the flash kernel; "head copy
(vocab, C)" reads the float32 head copy laid out untransposed; "bf16 head" computes the logits
from the packed bfloat16 head, rounded to bfloat16, then float32 (not what the model does: see
GPT._last_logits). The bound is bandwidth.bound_s at the fastest copy of all rounds. Needs a CPU with
native bfloat16 for the bf16 rows.
"""
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: core/ and model.py
from benchmarks import bandwidth  # noqa: E402
from core import cpu, runtime  # noqa: E402
from core.config import parse_args  # noqa: E402
from core.decoding.decode import inference_model, keep_float32_head  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402
from model import GPT  # noqa: E402


@dataclasses.dataclass
class LeverConfig:
    shape: str = "gpt2"      # one of benchmarks/bandwidth.py's SHAPES
    rounds: int = 5          # each round: one copy, then every variant's median of `steps` cached steps
    steps: int = 20
    threads: int = 1
    compile: bool = False    # also a compiled float32 model: its first calls (the start-up) and its step
    profile: bool = False    # also each variant's ops over `steps` cached steps: torch.profiler's self CPU time


def with_bf16_head(model: GPT) -> GPT:
    """The logits from the bfloat16 head (half the bytes of the float32 copy), packed as the Blocks' matrices
    are (cpu.PackedLinear), rounded to bfloat16."""
    linear = torch.nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False, device="meta")
    linear.weight = model.lm_head.weight
    head = cpu.PackedLinear(linear)
    model.lm_head.forward = lambda h: head(h.bfloat16()).float()  # h: ln_f's bfloat16 output, cast to float32
    return model


def with_vocab_by_c_head(model: GPT) -> GPT:
    """The float32 head copy as the head is laid out, (vocab, C), read as F.linear reads it (decode.Float32Head
    keeps it transposed, (C, vocab))."""
    model.lm_head.weight_t = model.lm_head.weight_t.t().contiguous().t()  # (C, vocab), strides (1, C)
    return model


def variants(config, compile: bool) -> dict[str, tuple[GPT, tuple[bool, bool]]]:
    """name: (model, (oneDNN at one row, SDPA's math backend for one query)); every model from the same weights."""
    def build(dtype, pack=True):
        torch.manual_seed(0)
        if pack:
            return inference_model(GPT(config), runtime.Runtime("cpu", "cpu", dtype))
        model = GPT(config).eval().to(dtype=runtime.DTYPES[dtype])  # as inference_model, but for the packing
        keep_float32_head(model)
        return model
    as_decoding = (False, False)  # model.py's kernel choice, flash
    out = {"float32": (build("float32"), as_decoding)}
    if cpu.cpu_native_bf16():
        plain, packed = build("bfloat16", pack=False), build("bfloat16")
        out |= {"bf16 unpacked, oneDNN": (plain, (True, False)),
                "bf16 unpacked, torch's GEMV (oneDNN off)": (plain, as_decoding),
                "bf16 packed (as decoding now)": (packed, as_decoding),
                "bf16 packed, math backend for one query": (packed, (False, True)),
                "bf16 packed, head copy (vocab, C)": (with_vocab_by_c_head(build("bfloat16")), as_decoding),
                "bf16 packed, bf16 head": (with_bf16_head(build("bfloat16")), as_decoding)}
    if compile:
        out["float32 compiled"] = (build("float32"), as_decoding)
        out["float32 compiled"][0].compile()
    return out


def compile_startup(model: GPT, context: int) -> list[float]:
    """Seconds of a compiled model's first cached steps at three positions: the first compiles, the second
    compiles again for a dynamic position, the third should not."""
    cache, times = model.new_kv_cache(1), []
    tokens = torch.zeros(1, context + 2, dtype=torch.long)
    with torch.no_grad():
        for pos in (context - 1, context, context + 1):
            cache.pos = pos
            t0 = time.perf_counter()
            model(tokens[:, pos:pos + 1], kv_cache=cache, last_only=True)
            times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def kernels(onednn: bool, math_query: bool):
    """The kernel choices for the block: if onednn, oneDNN for the unpacked matmuls at one row too
    (cpu.one_row_kernels made a no-op), else model.py's own choice (torch's GEMV at one row); packed
    matrices call oneDNN either way. SDPA's math backend for attention if math_query, else torch's
    choice (flash for one query)."""
    choice = cpu.one_row_kernels
    if onednn:
        cpu.one_row_kernels = lambda x: contextlib.nullcontext()
    try:
        with sdpa_kernel(SDPBackend.MATH) if math_query else contextlib.nullcontext():
            yield
    finally:
        cpu.one_row_kernels = choice


@torch.no_grad()
def profile_table(model: GPT, context: int, steps: int) -> str:
    """torch.profiler over `steps` cached steps (the prefill before it): each op with its input shapes and
    its self time per step. The profiler's op times are wall times: on a busy machine they include waits."""
    tokens = torch.zeros(1, context, dtype=torch.long)
    cache = model.new_kv_cache(1)
    model(tokens[:, :-1], kv_cache=cache, last_only=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            cache.pos = context - 1
            model(tokens[:, -1:], kv_cache=cache, last_only=True)
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    lines = ["| op | input shapes | calls per step | ms per step | share |", "|---|---|---:|---:|---:|"]
    lines += [f"| {e.key} | {str(e.input_shapes)[:70]} | {e.count / steps:.0f} | "
              f"{e.self_cpu_time_total / 1e3 / steps:.2f} | {e.self_cpu_time_total / total:.0%} |" for e in ops[:12]]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    cfg = parse_args(LeverConfig, argv)
    if cfg.shape not in bandwidth.SHAPES:
        raise UserError(f"unknown shape '{cfg.shape}'; use one of {', '.join(bandwidth.SHAPES)}")
    torch.set_num_threads(cfg.threads)
    name, config, context = bandwidth.SHAPES[cfg.shape]
    models = variants(config, cfg.compile)
    if cfg.compile:
        print("compiled start-up, s per first step at 3 positions:",
              [round(t, 1) for t in compile_startup(models["float32 compiled"][0], context)])
    steps, copies = {k: [] for k in models}, []
    for _ in range(cfg.rounds):
        copies.append(bandwidth.copy_bandwidth(repeats=5))
        for key, (model, on) in models.items():
            with kernels(*on):
                steps[key].append(bandwidth.cached_step_s(model, context, repeats=cfg.steps))
    if cfg.profile:
        for key, (model, on) in models.items():
            with kernels(*on):
                print(f"\n{key}: the ops of {cfg.steps} cached steps\n\n{profile_table(model, context, cfg.steps)}")
    bw = max(copies)
    print(f"{name}, context {context}, {cfg.threads} thread(s), {cfg.rounds} rounds; copy {bw / 1e9:.1f} GB/s at best, "
          f"{min(copies) / 1e9:.1f} at worst\n")
    print("| variant | step ms | step CPU ms | bound ms | step / bound |\n|---|---:|---:|---:|---:|")
    for key, (model, _) in models.items():
        itemsize = model.transformer.wte.weight.element_size()
        kv = bandwidth.kv_cache_bytes(config, context, itemsize)
        bound = bandwidth.bound_s(bandwidth.decode_weight_bytes(model), kv, bw)
        wall, cpu = (statistics.median(s[i] for s in steps[key]) for i in (0, 1))
        print(f"| {key} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} | {bound * 1e3:.2f} | {wall / bound:.2f}x |")


if __name__ == "__main__":
    run_cli(main)
