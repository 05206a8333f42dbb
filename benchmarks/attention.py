"""Attention memory: peak memory above the inputs while one causal attention runs, forward and forward + backward,
over context lengths T: the naive reference (model.scaled_dot_product_attention, which forms the (B, nh, T, T)
scores) against torch's fused F.scaled_dot_product_attention.
"""
import dataclasses
import math
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import OOM, int_list, markdown_table, mib, or_oom, peak_extra_bytes
from core import runtime
from core.config import at_least
from model import scaled_dot_product_attention


@dataclasses.dataclass
class Settings:
    # one layer's attention of the training model's width, B=1, over a range of T
    attn_batch_size: int = 1
    attn_n_head: int = 6
    attn_head_size: int = 64
    attn_lengths: str = "256,512,1024,2048,4096"
    attn_repeats: int = 1      # memory is deterministic for a given allocator; more repeats only cost time


PRESETS = {"gpt2": dict(attn_n_head=12, attn_lengths="256,512,1024,2048,4096,8192,16384", attn_repeats=3)}


def check(cfg) -> None:
    at_least(cfg, 1, "attn_repeats")
    int_list(cfg.attn_lengths, "attn_lengths")


ATTENTIONS = {"naive": lambda q, k, v: scaled_dot_product_attention(q, k, v, causal=True),  # forms (B, nh, T, T)
              "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}  # the sdpa backend's


def attention_run(attn: Callable, shape: tuple[int, ...], rt: runtime.Runtime, backward: bool) -> Callable[[], None]:
    """A closure running one attention over fresh random q, k, v of `shape` (allocated now, outside it)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(shape, generator=gen).to(rt.device, rt.ptdtype) for _ in range(4))
    if not backward:
        def run() -> None:
            with torch.no_grad():
                attn(q, k, v)
        return run
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def run_backward() -> None:
        attn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None  # after the peak: the gradients count, but only once
    return run_backward


def sdpa_kernels(shape: tuple[int, ...], rt: runtime.Runtime) -> str:
    """Which aten kernel(s) F.scaled_dot_product_attention dispatched to, read from a profile."""
    run = attention_run(ATTENTIONS["sdpa"], shape, rt, backward=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    kernels = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention")
    names = {e.name for e in prof.events() if e.name.startswith(kernels)}
    return ", ".join(sorted(names)) or "unknown"


def measure(cfg, rt: runtime.Runtime) -> dict:
    lengths = int_list(cfg.attn_lengths, "attn_lengths")
    B, nh, hs = cfg.attn_batch_size, cfg.attn_n_head, cfg.attn_head_size
    variants = {f"{name}_{mode}_bytes": (attn, mode == "forward_backward") for name, attn in ATTENTIONS.items()
                for mode in ("forward", "forward_backward")}
    for attn, backward in variants.values():  # warm-up: one-time buffers (thread pools, kernels) are not attention's
        or_oom(lambda: attention_run(attn, (B, nh, min(lengths), hs), rt, backward)(), rt)
    runs = {f"{key} T={T} #{i}": or_oom(lambda: attention_run(attn, (B, nh, T, hs), rt, backward), rt,
                                        lambda: OOM)  # its inputs did not fit
            for T in lengths for key, (attn, backward) in variants.items() for i in range(cfg.attn_repeats)}
    peaks, method = peak_extra_bytes(runs, rt)
    del runs
    rows = []
    for T in lengths:
        row = {"T": T, "score_matrix_bytes": B * nh * T * T * rt.ptdtype.itemsize}
        for key in variants:
            values = [peaks[f"{key} T={T} #{i}"] for i in range(cfg.attn_repeats)]
            row[key] = OOM if OOM in values else statistics.median(values)
        naive, sdpa = row["naive_forward_backward_bytes"], row["sdpa_forward_backward_bytes"]
        row["naive_over_sdpa"] = naive / sdpa if OOM not in (naive, sdpa) else None
        rows.append(row)
    result = {"shape": f"B={B}, {nh} heads, head size {hs}, {rt.dtype}, causal", "method": method,
              "sdpa_kernel": or_oom(lambda: sdpa_kernels((B, nh, min(lengths), hs), rt), rt), "rows": rows}
    measured = [row for row in rows if OOM not in row.values()]
    if len(measured) > 1:
        first, last = measured[0], measured[-1]
        span = math.log(last["T"] / first["T"])  # memory ~ T^exponent between the shortest and the longest T
        result["growth_exponent"] = {key: math.log(last[key] / first[key]) / span for key in variants}
    return result


def table(r: dict) -> str:
    rows = [[row["T"], mib(row["score_matrix_bytes"]), mib(row["naive_forward_bytes"]),
             mib(row["naive_forward_backward_bytes"]), mib(row["sdpa_forward_bytes"]),
             mib(row["sdpa_forward_backward_bytes"]),
             f"{row['naive_over_sdpa']:.1f}x" if row["naive_over_sdpa"] else "-"] for row in r["rows"]]
    text = (f"### Attention memory vs context length\none causal attention, {r['shape']}; peak memory above the "
            f"inputs, measured with {r['method']}; fused kernel: {r['sdpa_kernel']}\n\n"
            + markdown_table(["T", "scores B·nh·T² (theory)", "naive fwd", "naive fwd+bwd", "sdpa fwd",
                              "sdpa fwd+bwd", "naive/sdpa fwd+bwd"], rows))
    if "growth_exponent" in r:
        g = r["growth_exponent"]
        text += (f"\n\ngrowth as T^k from T={r['rows'][0]['T']} to {r['rows'][-1]['T']}: naive k = "
                 f"{g['naive_forward_bytes']:.2f} (fwd), {g['naive_forward_backward_bytes']:.2f} (fwd+bwd); sdpa k = "
                 f"{g['sdpa_forward_bytes']:.2f} (fwd), {g['sdpa_forward_backward_bytes']:.2f} (fwd+bwd)")
    return text
