"""Memory per process: ddp against fsdp, activation checkpointing, and which GPT-2 fits on which GPU.

The training section's model under ddp and fsdp in 1, 2 and 4 gloo processes on the CPU: each process's bytes of
parameters, gradients and optimizer state after one AdamW step; one process's peak memory and step time with and
without activation checkpointing; then a computed (not measured) table of which GPT-2 fits on which GPU.
"""
import functools
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.common import gpt_config, markdown_table, median_time, mib, model_text, num, num_threads, peak_extra_bytes
from core import kernels, runtime
from core.fileio import write_json
from core.training import checkpointing, optim, parallel
from core.training.memory import MemoryEstimate, estimate_training_memory, parameter_count
from model import GPT, GPT2_SHAPES, GPTConfig

MEMORY_WORLD_SIZES = (1, 2, 4)
GPU_GB = (24, 80, 141)
FITS_MICRO_BATCH, FITS_WORLD_SIZE = 4, 8  # sequences of 1024 tokens per GPU; GPUs sharing the model under fsdp
FITS_FRACTION = 0.9  # of a GPU's memory: room for the CUDA context, workspaces and fragmentation


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-process bytes of parameters, gradients and optimizer state (tied weights counted once; a DTensor: only
    its local shard, as a checkpoint's size is counted)."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {"params": checkpointing.state_bytes(params), "grads": checkpointing.state_bytes([p.grad for p in params]),
            "optimizer": checkpointing.state_bytes(list(optimizer.state.values()))}


def _memory_worker(rank: int, world_size: int, init_file: str, how: str, mc: GPTConfig, batch_size: int,
                   out_dir: str) -> None:
    """One spawned process: a training step under `how` (ddp|fsdp), then its state bytes to out_dir/<rank>.json."""
    torch.set_num_threads(1)
    if world_size > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                             world_size=world_size)
    rt = runtime.Runtime("cpu", "cpu", "float32", rank, rank, world_size)
    torch.manual_seed(0)
    model = GPT(mc)
    wrapped = parallel.parallelize(model, rt, how, activation_checkpointing=False, compile=False)
    optimizer = optim.build_optimizer(model, "adamw", 6e-4, 0.1, (0.9, 0.95), "cpu")
    x = torch.randint(mc.vocab_size, (batch_size, mc.block_size), generator=torch.Generator().manual_seed(rank))
    wrapped(x, x)[1].backward()
    optimizer.step()
    write_json(Path(out_dir) / f"{rank}.json", state_bytes(model, optimizer))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def spawned_state_bytes(how: str, world_size: int, mc: GPTConfig, batch_size: int) -> list[dict]:
    """Each process's parameter, gradient and optimizer bytes after one step, in `world_size` gloo processes."""
    with tempfile.TemporaryDirectory() as tmp:
        args = (world_size, f"{tmp}/store", how, mc, batch_size, tmp)
        if world_size == 1:  # plain training, no process group: run it here
            with num_threads(torch.get_num_threads()):  # the worker sets one thread
                _memory_worker(0, *args)
        else:
            torch.multiprocessing.spawn(_memory_worker, nprocs=world_size, args=args)
        return [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world_size)]


def measure(cfg, rt: runtime.Runtime) -> dict:
    mc = gpt_config(cfg, bias=cfg.bias)  # the training section's model
    state = []
    for how in parallel.PARALLELS:
        for n in MEMORY_WORLD_SIZES:
            ranks = spawned_state_bytes(how, n, mc, cfg.batch_size)
            state.append({"parallel": how, "processes": n, "per_rank": ranks,
                          **{k: max(r[k] for r in ranks) for k in ("params", "grads", "optimizer")}})
    return {"model": model_text(mc, cfg.batch_size), "state": state,
            "checkpointing": activation_checkpointing_rows(cfg, rt, mc),
            "fits": fits_rows(FITS_MICRO_BATCH, FITS_WORLD_SIZE)}


def activation_checkpointing_rows(cfg, rt: runtime.Runtime, mc: GPTConfig) -> list[dict]:
    """Peak memory above the weights and step time of forward + backward, without and with checkpointing."""
    torch.manual_seed(cfg.seed)
    models = {"off": kernels.choose_kernels(GPT(mc).to(rt.device)), "on": kernels.choose_kernels(GPT(mc).to(rt.device))}
    models["on"].load_state_dict(models["off"].state_dict())
    parallel.apply_activation_checkpointing(models["on"])
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randint(mc.vocab_size, (cfg.batch_size, mc.block_size), generator=gen).to(rt.device)

    def step(m: GPT) -> None:
        with rt.autocast():
            _, loss = m(x, x)
        loss.backward()
        m.zero_grad(set_to_none=True)  # grads freed: the peak is activations (+ transient gradients)

    steps = {k: functools.partial(step, m) for k, m in models.items()}
    peaks, _ = peak_extra_bytes(steps, rt)
    return [{"activation_checkpointing": k, "peak_bytes": peaks[k],
             "step_s": median_time(run, cfg.warmup, cfg.repeats, rt.synchronize)} for k, run in steps.items()]


def gpu_training_memory(config, how: str, world_size: int, micro_batch: int,
                        activation_checkpointing: bool = False) -> MemoryEstimate:
    """Bytes per GPU to train `config` as train.py runs it on CUDA with dtype=bfloat16 under parallel=`how`, one
    micro-step per optimizer step; what it counts and leaves out (hence FITS_FRACTION): docs/sharding.md."""
    return estimate_training_memory(config, micro_batch, "adamw", param_dtype=torch.float32,
                                    compute_dtype=torch.bfloat16, shards=world_size if how == "fsdp" else 1,
                                    activation_checkpointing=activation_checkpointing)


def fits_rows(micro_batch: int, world_size: int) -> list[dict]:
    """Computed: GB per GPU for each GPT-2 size, ddp and fsdp over world_size GPUs, and where it fits."""
    rows = []
    for name, shape in GPT2_SHAPES.items():
        config = GPTConfig(**shape)
        for how in parallel.PARALLELS:
            need = {ac: gpu_training_memory(config, how, world_size, micro_batch, ac).total / 1e9
                    for ac in (False, True)}
            fits = ["yes" if need[False] <= FITS_FRACTION * gb else
                    "with AC" if need[True] <= FITS_FRACTION * gb else "no" for gb in GPU_GB]
            rows.append({"model": name, "params": parameter_count(config), "parallel": how, "gb": need[False],
                         "gb_checkpointed": need[True], "fits": dict(zip(map(str, GPU_GB), fits))})
    return rows


def table(r: dict) -> str:
    state = [[row["parallel"], row["processes"], mib(row["params"]), mib(row["grads"]), mib(row["optimizer"]),
              mib(row["params"] + row["grads"] + row["optimizer"])] for row in r["state"]]
    ac = [[row["activation_checkpointing"], mib(row["peak_bytes"]), num(row["step_s"] * 1e3, 1)]
          for row in r["checkpointing"]]
    off, on = r["checkpointing"]
    fits = [[row["model"], f"{row['params'] / 1e6:,.0f}M", row["parallel"], f"{row['gb']:.1f}",
             f"{row['gb_checkpointed']:.1f}", *row["fits"].values()] for row in r["fits"]]
    return (f"### Memory per process: ddp vs fsdp, activation checkpointing\n{r['model']}\n\n"
            "bytes held by each process after one AdamW step (the largest rank), gloo processes on the CPU\n\n"
            + markdown_table(["parallel", "processes", "params", "grads", "AdamW state", "total"], state)
            + "\n\nforward + backward, one process\n\n"
            + markdown_table(["activation checkpointing", "peak memory", "step ms"], ac)
            + f"\n\ncheckpointing: {on['peak_bytes'] / off['peak_bytes']:.2f}x the peak memory, "
              f"{on['step_s'] / off['step_s']:.2f}x the step time\n\n"
            "Computed, not measured (benchmarks.memory.gpu_training_memory): GB per GPU to train GPT-2 with AdamW, "
            f"micro-batch {FITS_MICRO_BATCH} x 1024 tokens, fsdp over {FITS_WORLD_SIZE} GPUs; fits if <= "
            f"{FITS_FRACTION:.0%} of the GPU\n\n"
            + markdown_table(["model", "params", "parallel", "GB", "GB with AC", *(f"{gb} GB" for gb in GPU_GB)], fits))
