"""The fixed-shape decode step against the eager one, the measurement a CPU's choice of step is to be read from.

One cached step at context `context` (the decode section's model), three ways on the same weights: "eager" is
generate's step today (model.KVCache, its keys sliced to the position), "fixed" the StaticCache's (all block_size
slots, masked, the position a tensor) as the model runs it, "compiled" that step through decode.compile_step
(torch.compile; on CUDA a CUDA graph). Rows: each precision (float32 and int8 on a CPU, float32 and bfloat16 on
CUDA), each thread count on a CPU, each batch; rounds alternate the three, so load from other processes hits them
alike; each figure is the median over rounds of a round's median of `steps` steps, wall and CPU time
(time.process_time, every thread of this process). The compiled step's first three calls (its build, and on CUDA
the graph's warm-up and capture) are timed apart. A compile that fails is a row's result, not a crash.

    python bench.py --sections=decode                                     # at the end of the decode section
    python bench.py --preset=gpt2 --device=cuda --sections=decode --fixed_batches=1,4,16,64
"""
import statistics
import time

import torch

from benchmarks import bandwidth
from benchmarks.common import OOM, int_list, markdown_table, num, num_threads, or_oom, some_of
from core import runtime
from core.errors import first_line
from model import GPT, GPTConfig


WAYS = ("eager", "fixed", "compiled")


def row(cfg, model: GPT, batch: int, context: int, rt: runtime.Runtime) -> dict:
    """One precision, thread count and batch: each way's wall and CPU ms, alternated round by round."""
    ways, r = {}, {}
    for way in WAYS[:2 + cfg.compile]:
        try:
            ways[way] = bandwidth.cached_step(model, context, batch, way)
            t0 = time.perf_counter()
            for _ in range(3):  # compiled: the build, then on CUDA the graph's warm-up and capture
                with torch.no_grad():
                    ways[way]()
            rt.synchronize()
            r[f"{way}_first3_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a step that cannot compile is a result
            ways.pop(way, None)
            r[f"{way}_error"] = OOM if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {first_line(e)}"
    measured = {way: [] for way in ways}
    for _ in range(cfg.fixed_rounds):
        for way, step in ways.items():
            measured[way].append(bandwidth.step_times(step, 0, cfg.fixed_steps, rt.synchronize))
    for way, rounds_times in measured.items():
        r[f"{way}_ms"] = statistics.median(t[0] for t in rounds_times) * 1e3
        r[f"{way}_cpu_ms"] = statistics.median(t[1] for t in rounds_times) * 1e3
    return r


def precisions(cfg, device_type: str) -> list[str]:
    """The rows' precisions: fixed_precisions, where auto is float32,int8 on a CPU and float32,bfloat16 on CUDA."""
    if cfg.fixed_precisions == "auto":
        return ["float32", "int8"] if device_type == "cpu" else ["float32", "bfloat16"]
    return some_of(cfg.fixed_precisions, ("float32", "bfloat16", "int8", "int4"), "fixed_precisions")


def measure(cfg, config: GPTConfig, rt: runtime.Runtime) -> dict:
    """The decode section's fixed_* settings: a row per precision, thread count (on a CPU: one and --threads) and
    batch, at context block_size // 2."""
    rows, context = [], config.block_size // 2
    threads = sorted({1, torch.get_num_threads()}) if rt.device_type == "cpu" else [torch.get_num_threads()]
    for precision in precisions(cfg, rt.device_type):
        model = bandwidth.decoding_model(config, rt, precision, cfg.seed)  # the same weights
        for t in threads:
            with num_threads(t):
                for batch in int_list(cfg.fixed_batches, "fixed_batches"):
                    r = or_oom(lambda: row(cfg, model, batch, context, rt), rt, {"eager_error": OOM})
                    rows.append({"precision": precision, "threads": t, "batch": batch} | r)
                    print(f"  fixed step: {rows[-1]}", flush=True)
    return {"context": context, "rounds": cfg.fixed_rounds, "steps": cfg.fixed_steps, "device": rt.device_type,
            "rows": rows}


def table(r: dict) -> str:
    cpu = r["device"] == "cpu"
    # on a CPU, CPU time: a shared machine's waits for a core left out
    clock, key = ("CPU ms", "_cpu_ms") if cpu else ("ms", "_ms")

    def cell(x: dict, way: str) -> str:
        return x.get(f"{way}_error") or (num(x[way + key], 3) if way + key in x else "-")

    def ratio(x: dict, way: str) -> str:
        return f"{x[way + key] / x['eager' + key]:.2f}x" if way + key in x and "eager" + key in x else "-"
    rows = [[x["precision"], x["threads"] if cpu else "-", x["batch"], cell(x, "eager"), cell(x, "fixed"),
             cell(x, "compiled"), ratio(x, "fixed"), ratio(x, "compiled"),
             num(x["compiled_first3_s"], 1) if "compiled_first3_s" in x else "-"] for x in r["rows"]]
    return (f"### The fixed-shape decode step against the eager one\ncontext {r['context']}; {r['rounds']} rounds "
            f"alternated, each way's median of {r['steps']} steps per round, the median over rounds\n\n"
            + markdown_table(["precision", "threads", "batch", f"eager {clock}", f"fixed {clock}",
                              f"compiled {clock}", "fixed / eager", "compiled / eager", "compiled: first 3 calls s"],
                             rows))
