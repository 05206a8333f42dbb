"""Decoding against the memory-bandwidth bound.

A cached decode step at batch 1 does 2 FLOPs (one multiply-add) per weight it reads, far too few to keep a CPU's or
GPU's arithmetic busy: it is bound by memory. Each step reads every weight the token passes through once, and the keys
and values cached so far. No step can beat those bytes divided by the machine's memory bandwidth (copy_bandwidth: a
measured copy of a buffer far larger than the caches):

    bound_s = (decode_weight_bytes(model) + kv_cache_bytes(config, context, itemsize)) / bandwidth

The arithmetic is pure (but for the timed copy). bench.py's decode section prints the cached step of the CPU quick
start's model and of GPT-2 small's shape (SHAPES; --bound_models) at batch 1 against the bound, in float32 and, where
the device computes it natively, bfloat16 (docs/performance.md, "Decoding against the bandwidth bound"):

    python bench.py --sections=decode                          # the decode section, the bound table last
    python bench.py --sections=decode --bound_models=gpt2      # GPT-2 small's shape only
"""
import statistics
import time
from typing import Callable

import torch

from benchmarks.common import markdown_table
from core import runtime
from core.decoding.cache import StaticCache
from core.decoding.decode import FixedStep, compile_step, inference_model
from model import GPT, GPTConfig


def copy_bandwidth(n_bytes: int = 1 << 28, repeats: int = 10, clock: Callable[[], float] = time.perf_counter,
                   device: str = "cpu", synchronize: Callable[[], None] = lambda: None) -> float:
    """Bytes per second of dst.copy_(src) over n_bytes, the fastest of `repeats`: each copy reads n_bytes and writes
    n_bytes, counted as 2 x n_bytes moved. 256 MiB by default, past any CPU's last-level cache, so it is DRAM's rate;
    the fastest, since slower runs measure other processes' traffic."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: the pages of dst are mapped now
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        dst.copy_(src)
        synchronize()
        best = min(best, clock() - t0)
    return 2 * src.numel() * src.element_size() / best


def decode_weight_bytes(model: GPT) -> int:
    """Bytes of the weights one cached decode step reads: every parameter, at its own dtype, but the embedding
    tables the step only looks one row up in (the position table; the token table when the head is untied or swapped,
    else the head reads it whole), and the matrices modules swapped in hold (cpu.PackedLinear, quantize.QuantizedLinear:
    their weight_bytes). Shared tensors count once."""
    c, seen, total = model.config, set(), 0
    lookups = {id(model.transformer.wpe.weight)} if c.pos_embedding == "learned" else set()
    if getattr(model.lm_head, "weight", None) is not model.transformer.wte.weight:
        lookups.add(id(model.transformer.wte.weight))
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        rows = p[0].numel() if id(p) in lookups else p.numel()
        total += rows * p.element_size()
    return total + sum(getattr(m, "weight_bytes", 0) for m in model.modules())


def kv_cache_bytes(config: GPTConfig, context: int, itemsize: int, batch_size: int = 1) -> int:
    """Bytes of the keys and values a step attends to: `context` positions (the cached ones and the new
    token's) of every layer, kv_heads x head_size each, keys and values."""
    return 2 * config.n_layer * batch_size * config.kv_heads * context * config.head_size * itemsize


def bound_s(weight_bytes: int, kv_bytes: int, bandwidth: float) -> float:
    """The fewest seconds a memory-bound step can take: every byte it reads, at the machine's bandwidth."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return (weight_bytes + kv_bytes) / bandwidth


def decoding_model(config: GPTConfig, rt: runtime.Runtime, precision: str, seed: int = 0) -> GPT:
    """GPT(config) from seed as sample.py decodes it (inference_model) on rt's device: precision is a dtype, or a
    --quantize kind (int8, int4) of float32 weights."""
    torch.manual_seed(seed)
    quantize = precision if precision in ("int8", "int4") else "none"
    dtype = "float32" if quantize != "none" else precision
    return inference_model(GPT(config), runtime.Runtime(rt.device, rt.device_type, dtype), quantize=quantize)[0]


def cached_step(model: GPT, context: int, batch: int = 1, way: str = "eager"):
    """A function running one cached decode step of `batch` rows: token `context` fed after context - 1 cached,
    at that position every time. way: "eager", model.KVCache's step (generate's); "fixed", the fixed-shape step over
    a StaticCache; "compiled", that step through decode.compile_step (on CUDA a CUDA graph)."""
    gen = torch.Generator().manual_seed(0)
    device = model.transformer.wte.weight.device
    tokens = torch.randint(model.config.vocab_size, (batch, context), generator=gen).to(device)  # (batch, context)
    cache = model.new_kv_cache(batch) if way == "eager" else StaticCache(model, batch)
    if context > 1:
        with torch.no_grad():
            model(tokens[:, :-1], kv_cache=cache) if way == "eager" else cache.feed(model, tokens[:, :-1])
    step = FixedStep(model, cache) if way != "eager" else None
    if way == "compiled":
        torch.compiler.reset()  # compiled anew: at this thread count, and within compile's limit of recompiles
        step = compile_step(step, device.type)

    def one_step():
        cache.pos = context - 1  # the same position every time
        if step is None:
            return model(tokens[:, -1:], kv_cache=cache, last_only=True)
        cache.at.fill_(context - 1)
        return cache.feed(model, tokens[:, -1:], step)
    return one_step


@torch.no_grad()
def step_times(step: Callable[[], object], warmup: int = 3, repeats: int = 20,
               synchronize: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter,
               cpu_clock: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """(wall, CPU) seconds of step(), each the median of `repeats` after `warmup`. CPU seconds are every thread's of
    this process: on a shared machine the wall time also holds the waits for a core, the CPU time does not."""
    walls, cpus = [], []
    for _ in range(warmup + repeats):
        t0, c0 = clock(), cpu_clock()
        step()
        synchronize()
        walls.append(clock() - t0)
        cpus.append(cpu_clock() - c0)
    return statistics.median(walls[warmup:]), statistics.median(cpus[warmup:])


SHAPES = {  # name: (what the table calls it, GPTConfig, context of the measured step)
    "quickstart": ("quick start (4 x 128, vocab 65)",
                   GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0), 64),
    "gpt2": ("GPT-2 small (12 x 768, vocab 50,304)", GPTConfig(dropout=0.0), 512),
}


def measure(shapes: list[str], rt: runtime.Runtime, steps: int, seed: int = 0) -> dict:
    """The copy's bandwidth, then one row per shape and dtype (float32, and bfloat16 where the device computes
    it natively): the cached step at batch 1 against its bound. The model is cast once to the dtype, as
    sample.py decodes (inference_model)."""
    bandwidth = copy_bandwidth(device=rt.device, synchronize=rt.synchronize)
    dtypes = ["float32"] + (["bfloat16"] if runtime.native_bf16(rt.device) else [])
    rows = []
    for shape in shapes:
        name, config, context = SHAPES[shape]
        for dtype in dtypes:
            model = decoding_model(config, rt, dtype, seed)
            w = decode_weight_bytes(model)
            kv = kv_cache_bytes(config, context, runtime.DTYPES[dtype].itemsize)
            wall, cpu = step_times(cached_step(model, context), repeats=steps, synchronize=rt.synchronize)
            bound = bound_s(w, kv, bandwidth)
            rows.append({"model": name, "dtype": dtype, "context": context, "weight_bytes": w, "kv_bytes": kv,
                         "bound_ms": bound * 1e3, "step_ms": wall * 1e3, "step_cpu_ms": cpu * 1e3,
                         "step_over_bound": wall / bound})
    return {"bandwidth_gb_s": bandwidth / 1e9, "threads": torch.get_num_threads(), "steps": steps, "rows": rows}


def table(r: dict) -> str:
    head = (f"### Decoding against the bandwidth bound\ncopy bandwidth {r['bandwidth_gb_s']:.1f} GB/s, "
            f"{r['threads']} torch thread(s); batch 1, the median of {r['steps']} cached steps; the bound is "
            "(weights read + KV read) / bandwidth\n\n")
    columns = ["model", "dtype", "context", "weights read", "KV read", "bound ms", "cached step ms", "step CPU ms",
               "step / bound"]
    rows = [[x["model"], x["dtype"], x["context"], f"{x['weight_bytes'] / 1e6:.2f} MB", f"{x['kv_bytes'] / 1e6:.2f} MB",
             f"{x['bound_ms']:.3f}", f"{x['step_ms']:.3f}", f"{x['step_cpu_ms']:.3f}", f"{x['step_over_bound']:.2f}x"]
            for x in r["rows"]]
    return head + markdown_table(columns, rows)
