"""Decoding against the memory-bandwidth bound.

A cached decode step at batch 1 does 2 FLOPs (one multiply-add) per weight it reads, far too few to keep
a CPU's or GPU's arithmetic busy: it is bound by memory. Each step reads every weight the token passes through
once, and the keys and values cached so far. No step can beat those bytes divided by the machine's
memory bandwidth (copy_bandwidth: a measured copy of a buffer far larger than the caches):

    bound_s = (decode_weight_bytes(model) + kv_cache_bytes(config, context, itemsize)) / bandwidth

The functions are pure (but for the timed copy) so that bench.py's decode section can print its cached
step against the bound. `python -m benchmarks.bandwidth` measures the bandwidth and the cached step of
the CPU quick start's model and GPT-2 small's shape at batch 1, in float32 and, where the CPU computes
it natively, bfloat16 (docs/performance.md, "Decoding against the bandwidth bound").
"""
import statistics
import sys
import time
from typing import Callable

import torch

from core import runtime
from model import GPT, GPTConfig


def copy_bandwidth(n_bytes: int = 1 << 28, repeats: int = 10, clock: Callable[[], float] = time.perf_counter) -> float:
    """Bytes per second of dst.copy_(src) over n_bytes, the fastest of `repeats`: each copy reads n_bytes
    and writes n_bytes, counted as 2 x n_bytes moved. 256 MiB by default, past any CPU's last-level
    cache, so it is DRAM's rate; the fastest, since slower runs measure other processes' traffic."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: the pages of dst are mapped now
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        dst.copy_(src)
        best = min(best, clock() - t0)
    return 2 * src.numel() * src.element_size() / best


def decode_weight_bytes(model: GPT) -> int:
    """Bytes of the weights one cached decode step reads: every parameter, at its own dtype, but the
    embedding tables the step only looks one row up in (the position table; the token table when the
    head is untied, else the head reads it whole). Shared tensors count once."""
    c, seen, total = model.config, set(), 0
    lookups = {id(model.transformer.wpe.weight)} if c.pos_embedding == "learned" else set()
    if model.lm_head.weight is not model.transformer.wte.weight:
        lookups.add(id(model.transformer.wte.weight))
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        rows = p[0].numel() if id(p) in lookups else p.numel()
        total += rows * p.element_size()
    return total


def kv_cache_bytes(config: GPTConfig, context: int, itemsize: int, batch_size: int = 1) -> int:
    """Bytes of the keys and values a step attends to: `context` positions (the cached ones and the new
    token's) of every layer, kv_heads x head_size each, keys and values."""
    return 2 * config.n_layer * batch_size * config.kv_heads * context * config.head_size * itemsize


def bound_s(weight_bytes: int, kv_bytes: int, bandwidth: float) -> float:
    """The fewest seconds a memory-bound step can take: every byte it reads, at the machine's bandwidth."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return (weight_bytes + kv_bytes) / bandwidth


def cached_step_s(model: GPT, context: int, warmup: int = 3, repeats: int = 20) -> float:
    """Median seconds of one cached decode step at batch 1: token `context` fed after context - 1 cached."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.config.vocab_size, (1, context), generator=gen)  # (1, context)
    cache = model.new_kv_cache(1)
    times = []
    with torch.no_grad():
        model(tokens[:, :context - 1], kv_cache=cache, last_only=True)
        for i in range(warmup + repeats):
            cache.pos = context - 1  # the same position every time
            t0 = time.perf_counter()
            model(tokens[:, context - 1:], kv_cache=cache, last_only=True)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


SHAPES = {  # name: (GPTConfig, context of the measured step)
    "quick start (4 x 128, vocab 65)": (GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65,
                                                  dropout=0.0), 64),
    "GPT-2 small (12 x 768, vocab 50,304)": (GPTConfig(dropout=0.0), 512),
}


def main(argv: list[str]) -> str:
    """One row per shape and dtype: the cached step, its bound, and the ratio; markdown on stdout."""
    torch.set_num_threads(1)
    bandwidth = copy_bandwidth()
    dtypes = ["float32"] + (["bfloat16"] if runtime.cpu_native_bf16() else [])
    lines = [f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, one thread, torch {torch.__version__}, "
             f"capability {torch.backends.cpu.get_cpu_capability()}", "",
             "| model | dtype | context | weights read | KV read | bound ms | cached step ms | step / bound |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, (config, context) in SHAPES.items():
        torch.manual_seed(0)
        for dtype in dtypes:
            model = runtime.inference_model(GPT(config), runtime.Runtime("cpu", "cpu", dtype))
            w = decode_weight_bytes(model)
            kv = kv_cache_bytes(config, context, runtime.DTYPES[dtype].itemsize)
            step, bound = cached_step_s(model, context), bound_s(w, kv, bandwidth)
            lines.append(f"| {name} | {dtype} | {context} | {w / 1e6:.2f} MB | {kv / 1e6:.2f} MB | {bound * 1e3:.3f} | "
                         f"{step * 1e3:.3f} | {step / bound:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
