"""Training iteration: train.py's step, run as a user runs train.py, against nanoGPT's plain loop.

train.py runs as its own process, timed by the "ms" its log.jsonl records per step after untimed warm-up; the plain
loop (benchmarks/nanogpt.py) runs the same model, data and threads in this process; and train.py with --recipe_config
on top, all in alternating chunks of loop_steps iterations, the median over chunks (docs/performance.md, loop).
"""
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import nanogpt
from benchmarks.common import ROOT, markdown_table, model_text, num
from core import kernels, runtime
from core.config import apply_overrides, at_least, read_config_file
from core.errors import UserError
from core.training.train_config import TrainConfig
from model import GPT, GPTConfig


@dataclasses.dataclass
class Settings:
    # train.py's iteration against a plain loop: this config file's model, batch and optimizer
    loop_config: str = "config/train_shakespeare_char_cpu.py"
    loop_steps: int = 20       # iterations per timed chunk; `repeats` chunks of each, alternating
    recipe_config: str = "config/modern.py"  # timed beside them: train.py with this file after loop_config


PRESETS = {"gpt2": dict(loop_config="config/train_shakespeare_char.py")}


def check(cfg) -> None:
    at_least(cfg, 1, "loop_steps")


def train_py_ms(cfg, tmp: str, overrides: dict, warm: int, n: int, *recipe: str) -> list[float]:
    """ms of each of train.py's steps after `warm` untimed ones, from its log.jsonl; `recipe`: config files
    read after loop_config."""
    out, threads = Path(tmp) / ("out-recipe" if recipe else "out"), torch.get_num_threads()
    run = overrides | dict(max_iters=warm + n, log_interval=1, eval_interval=warm + n + 1, eval_iters=1, compile=False,
                           seed=cfg.seed, out_dir=str(out), overwrite=True, threads=threads)  # each chunk anew
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), cfg.loop_config, *recipe,
                           *(f"--{k}={v}" for k, v in run.items())], capture_output=True, text=True,
                          env=os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    if done.returncode:
        raise UserError(f"train.py failed in the loop section: {(done.stderr.strip() or '?').splitlines()[-1]}")
    return [r["ms"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "ms" in r][warm:]


def measure(cfg, rt: runtime.Runtime) -> dict:
    if rt.distributed:
        raise UserError("the loop section runs on one process; start bench.py without torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        source, vocab = nanogpt.char_dataset(Path(tmp))
        overrides = read_config_file(cfg.loop_config) | dict(data_dir=tmp, device=rt.device, dtype=rt.dtype,
                                                             out_dir=str(Path(tmp) / "out"), vocab_size=vocab)
        tcfg = apply_overrides(TrainConfig(), overrides, cfg.loop_config)
        torch.manual_seed(cfg.seed)
        model = kernels.choose_kernels(GPT(GPTConfig(**tcfg.model_args(), vocab_size=vocab)).to(rt.device).train())
        optimizer = nanogpt.adamw(model, tcfg, rt.device_type)
        its, timed = itertools.count(), []  # the plain loop's iterations; train.py's steps timed per chunk
        warm = max(1, cfg.warmup) * 2
        train_bin = Path(tmp) / "train.bin"
        step = nanogpt.train_step(model, optimizer, lambda it: nanogpt.get_batch(
            train_bin, tcfg.block_size, tcfg.batch_size, rt.device), tcfg, rt)

        def plain(n: int) -> float:
            rt.synchronize()
            t0 = time.perf_counter()
            for it in itertools.islice(its, n):
                loss = step(it)
                if it % tcfg.log_interval == 0:
                    loss.item()  # nanoGPT's logging sync
            rt.synchronize()
            return (time.perf_counter() - t0) / n

        def ours(n: int, *recipe: str) -> float:
            ms = train_py_ms(cfg, tmp, overrides, warm, n, *recipe)
            if not recipe:
                timed.append(len(ms))
            return statistics.fmean(ms) / 1e3

        plain(warm)
        times = {"plain": [], "train_py": [], "recipe": []}
        for _ in range(cfg.repeats):  # alternating, so that load from other processes hits all alike
            times["plain"].append(plain(cfg.loop_steps))
            times["train_py"].append(ours(cfg.loop_steps))
            times["recipe"].append(ours(cfg.loop_steps, cfg.recipe_config))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"config": cfg.loop_config, "corpus": source, "model": model_text(model.config, tcfg.batch_size),
            "accum": tcfg.gradient_accumulation_steps, "steps_per_chunk": cfg.loop_steps, "chunks": cfg.repeats,
            "plain_ms": ms["plain"], "train_py_ms": ms["train_py"], "train_py_over_plain": ms["train_py"] / ms["plain"],
            "recipe_config": cfg.recipe_config, "recipe_ms": ms["recipe"],
            # each chunk against the classic chunk run just before it: load that changes over the run cancels
            "recipe_over_train_py": statistics.median(r / c for r, c in zip(times["recipe"], times["train_py"])),
            "muon_newton_schulz": "bfloat16" if runtime.native_bf16(rt.device) else "float32",
            "chunk_ms": {name: [t * 1e3 for t in ts] for name, ts in times.items()}, "train_py_steps": timed}


def table(r: dict) -> str:
    rows = [["plain loop (nanoGPT's)", num(r["plain_ms"], 2), "1.00x"],
            ["train.py", num(r["train_py_ms"], 2), f"{r['train_py_over_plain']:.2f}x"],
            # Muon's Newton-Schulz runs in bf16 only where bf16 is native (core/training/optim.py)
            [f"train.py + {r['recipe_config']} (Newton-Schulz in {r['muon_newton_schulz']})", num(r["recipe_ms"], 2),
             f"{r['recipe_ms'] / r['plain_ms']:.2f}x"]]
    return (f"### Training iteration: train.py against a plain loop, and the modern recipe\n{r['config']}: {r['model']}, "
            f"accumulation {r['accum']}; median of {r['chunks']} chunks of {r['steps_per_chunk']} iterations each, "
            f"alternating\n\n" + markdown_table(["loop", "ms / iteration", "vs plain"], rows)
            + f"\n\n{r['recipe_config']} / classic train.py: {r['recipe_over_train_py']:.2f}x "
              "(median over chunks of each against the one before it)")
