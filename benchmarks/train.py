"""Training step: forward + backward + AdamW step on a fixed random batch, at each micro-batch of a sweep.

MFU against runtime.peak_flops_with_source (CPU: a measured float32 matmul, so CPU MFU is relative to what a plain
matmul reaches here). Compiled: its first step per micro-batch (the build) timed apart, a failure a row. One row per
mode and micro-batch of train_batch_sizes, OOM where it runs out. The model (batch_size ... bias) is memory.py's too.

    python bench.py --preset=gpt2 --device=cuda --sections=train          # the sweep, eager and compiled
    python bench.py --sections=train --train_batch_sizes=2,4,8             # on the CPU
"""
import dataclasses
import time

import torch

from benchmarks.common import OOM, gpt_config, int_list, markdown_table, median_time, mib, model_text, num, or_oom
from core import kernels, runtime
from core.errors import first_line
from core.training import optim
from model import GPT


@dataclasses.dataclass
class Settings:
    # the baby GPT (data/shakespeare_char, 65 characters) at batch 4
    batch_size: int = 4
    block_size: int = 256      # 4 batch * 256 context = 1,024 tokens per step
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    vocab_size: int = 65
    bias: bool = False
    compile: bool = True
    train_batch_sizes: str = ""  # micro-batches swept (comma-separated); "": batch_size alone


PRESETS = {"gpt2": dict(batch_size=8, block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_size=50304,
                        bias=True, train_batch_sizes="8,16,32,64")}


def check(cfg) -> None:
    gpt_config(cfg, bias=cfg.bias)
    batch_sizes(cfg)


def batch_sizes(cfg) -> list[int]:
    return int_list(cfg.train_batch_sizes, "train_batch_sizes") if cfg.train_batch_sizes else [cfg.batch_size]


def measure(cfg, rt: runtime.Runtime) -> dict:
    torch.manual_seed(cfg.seed)
    mc = gpt_config(cfg, bias=cfg.bias)
    model = kernels.choose_kernels(GPT(mc).to(rt.device))
    optimizer = optim.build_optimizer(model, "adamw", 6e-4, 0.1, (0.9, 0.95), rt.device_type)
    scaler = rt.grad_scaler()
    gen = torch.Generator().manual_seed(cfg.seed)
    peak, peak_source = runtime.peak_flops_with_source(rt)
    compiled = []  # torch.compile(model), made at the first compiled row

    def step(m: torch.nn.Module, x, y) -> None:
        with rt.autocast():
            loss = m(x, y)[1]  # as train.py: the logits are not held through backward
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def row(mode: str, m: torch.nn.Module, B: int, x, y, build_s: float | None = None) -> dict:
        dt = or_oom(lambda: median_time(lambda: step(m, x, y), cfg.warmup, cfg.repeats, rt.synchronize), rt)
        if dt == OOM:
            return {"mode": mode, "batch_size": B, "error": OOM}
        r = {"mode": mode, "batch_size": B, "step_s": dt, "tokens_per_s": B * mc.block_size / dt,
             "mfu": model.estimate_mfu(B, dt, peak) if peak else None}
        if build_s is not None:
            r["build_s"] = build_s
        if rt.device_type == "cuda":
            r["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        return r

    def compiled_row(B: int, x, y) -> dict:
        t0 = time.perf_counter()
        try:  # the first call at a new shape traces and builds the kernels
            compiled[:] = compiled or [torch.compile(model)]
            if or_oom(lambda: step(compiled[0], x, y), rt) == OOM:
                return {"mode": "compiled", "batch_size": B, "error": OOM}
        except Exception as e:  # noqa: BLE001 - any compiler failure is a result to report, not a crash
            return {"mode": "compiled", "batch_size": B,
                    "error": f"compile failed: {type(e).__name__}: {first_line(e)}"}
        rt.synchronize()
        return row("compiled", compiled[0], B, x, y, time.perf_counter() - t0)

    rows = []
    for B in batch_sizes(cfg):
        x, y = (torch.randint(mc.vocab_size, (B, mc.block_size), generator=gen).to(rt.device) for _ in range(2))
        for mode in ("eager", "compiled")[:1 + cfg.compile]:
            if rt.device_type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rows.append(row(mode, model, B, x, y) if mode == "eager" else compiled_row(B, x, y))
            optimizer.zero_grad(set_to_none=True)  # an OOM's half-made gradients go
        del x, y
    result = {"model": model_text(mc, cfg.batch_size), "params": model.get_num_params(),
              "tokens_per_step": cfg.batch_size * mc.block_size, "flops_per_token": model.flops_per_token(),
              "peak_flops": peak, "peak_flops_source": peak_source, "rows": rows}
    if len(rows) >= 2 and "error" not in rows[0] and "error" not in rows[1] and rows[1]["mode"] == "compiled":
        result["compiled_over_eager"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]  # at the first size
    return result


def table(r: dict) -> str:
    peak = f"{r['peak_flops'] / 1e9:,.1f} GFLOP/s" if r["peak_flops"] else "n/a"
    with_memory = any("peak_memory_bytes" in row for row in r["rows"])  # CUDA only
    rows = []
    for row in r["rows"]:
        if "error" in row:
            rows.append([row["mode"], row["batch_size"], "-", row["error"], "-", "-"] + ["-"] * with_memory)
            continue
        mfu = f"{row['mfu'] * 100:.1f}%" if row["mfu"] is not None else "n/a"
        build = num(row["build_s"], 1) if "build_s" in row else "-"
        rows.append([row["mode"], row["batch_size"], build, num(row["step_s"] * 1e3, 1), num(row["tokens_per_s"]), mfu]
                    + ([mib(row["peak_memory_bytes"])] if with_memory else []))
    text = (f"### Training step (forward + backward + AdamW)\n{r['model']}; {r['params'] / 1e6:.2f}M parameters; "
            f"each row a micro-batch of that many sequences\npeak for MFU: {peak} ({r['peak_flops_source']})\n\n"
            + markdown_table(["mode", "batch", "build s (1st step)", "step ms", "tokens/s", "MFU"]
                             + ["peak memory"] * with_memory, rows))
    if "compiled_over_eager" in r:
        text += f"\n\ncompiled / eager tokens/s at batch {r['rows'][0]['batch_size']}: {r['compiled_over_eager']:.2f}x"
    return text
