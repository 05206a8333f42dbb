"""Performance, measured side by side in one run: training step, attention memory, decoding, data preparation.

    python bench.py                                    # CPU sizes: ~2 min on 2 cores (+~1 min for a first compile)
    python bench.py --compile=False --repeats=5        # skip torch.compile; more timed repeats
    python bench.py --threads=0                        # all cores (torch's default); the default is 1, see THREADS
    python bench.py --sections=attention,decode        # only some of train, loop, attention, decode, prepare, rolling,
                                                       # memory, serve, speedrun (not in the default list: it trains for minutes)
    python bench.py --sections=memory                  # ddp vs fsdp state per process; activation checkpointing
    python bench.py --sections=muon --threads=0        # Muon's step alone: torch's against BatchedMuon, bf16 and float32
    python bench.py --sections=serve                   # serve.py's throughput at 1, 4, 16 clients vs in-process
    python bench.py --sections=speedrun --speedrun_seeds=1337,1338   # time to a val loss: nanoGPT vs ours (docs/speedrun.md)
    python bench.py --preset=gpt2 --device=cuda --dtype=bfloat16     # GPT-2 small; attention up to T = 16384
    TIKTOKEN_CACHE_DIR=../shared/tiktoken_cache python bench.py   # offline: GPT-2's BPE file for the prepare section
    python bench.py --batch_size=8 --block_size=1024 --n_embd=768 --n_head=12 --n_layer=12 --vocab_size=50304 \\
        --device=cuda --dtype=bfloat16                 # the same training model, flag by flag

Every time is the median of `repeats` timed runs after `warmup` untimed ones; every ratio compares two
figures from the same run. Weights are random (speed does not depend on them) and decoding is greedy.
The tables go to stdout in Markdown, and the same figures with the machine's description to --out (JSON),
rewritten after each section. A figure that runs out of device memory reads "OOM"; the rest still run.

How each figure is measured:
  train      forward + backward + AdamW step on a fixed random batch; MFU = model.estimate_mfu against
             flops.peak_flops (GPU: the datasheet; CPU: a measured float32 matmul, so CPU MFU is
             relative to what a plain matmul reaches here). Compiled: torch.compile of the same model;
             its first step (the build) is timed apart, and a failure is reported in the table.
  loop       train.py's step, run as a user runs train.py (its batches, non-finite guard, stop flags; the
             "ms" its log.jsonl records per step, after untimed warm-up steps), against a plain loop of the same
             model and data written as nanoGPT's train.py does it (np.memmap batches, forward, backward, clip,
             AdamW) in this process: the CPU quick start's config (--loop_config), the same threads, chunks of
             loop_steps iterations alternating between the two, median over chunks of ms per iteration.
             Beside them, in the same alternation, train.py with --recipe_config on top (config/modern.py:
             Muon + the model switches), as a user runs `train.py config/... config/modern.py`.
  muon       one optimizer step alone on the hidden matrices of that recipe's model (--muon_shape on top),
             fixed gradients: torch.optim.Muon (Newton-Schulz in bf16, one matrix at a time) against
             core.optim.BatchedMuon in bf16 and in float32 (each shape's matrices as one batch); the row
             core.optim.build_optimizer picks on this device is marked.
  attention  peak memory above the inputs while one causal attention runs, without grad (forward) and
             with grad (forward + backward): model.scaled_dot_product_attention (the naive reference,
             which forms the (B, nh, T, T) scores) against torch's fused F.scaled_dot_product_attention.
             CUDA: torch.cuda.max_memory_allocated. CPU: the allocation and free events that
             torch.profiler(profile_memory=True) records from torch's CPU allocator, summed in time
             order, the peak of that running total (kernels' scratch buffers included).
  decode     the model cast once to --dtype, as sample.py decodes (runtime.inference_model); decode_batch_size
             rows at once. Per-token latency at each context length: no cache = one forward over the whole context
             (what generate(use_cache=False) does per token); cache = one token through a KV cache
             already holding the context. Then a whole generate() run each way, timed token by token,
             past the context moving the window as sample.py does (block_size // 2 at a time; see
             --gen_window_shift).
  rolling    decoding past the context with window_shift=1 (nanoGPT's rule: the window slides one token
             per step), per token, on the decode model: learned positions (the cache is refilled at
             every step), RoPE with the same refills, and RoPE with the rolling KV cache (one token
             per step; sliding-window attention, see GPT.generate's rolling_cache).
  prepare    core.prepare.prepare_text_corpus with GPT-2's BPE (data/shakespeare/prepare.py's path):
             read, encode, write train.bin / val.bin / meta.json to a temporary folder.
  memory     the training model under parallel=ddp and fsdp in 1, 2 and 4 gloo processes spawned on the
             CPU: after one AdamW step, the bytes each process holds for parameters, gradients and
             optimizer state (a DTensor counts its local shard; core.parallel.state_bytes). Then one
             process's peak memory and step time for forward + backward with and without activation
             checkpointing (peak measured as in attention). Last, core.memory.gpu_training_memory'
             computed (not measured) table of which GPT-2 fits on which GPU.
  serve      serve.py started as its own process on a loopback port, serving the decode model (random
             weights, a stand-in character vocabulary) from a temporary checkpoint. For each count in
             serve_clients, that many concurrent /v1/completions requests (one per client, sampled with
             their own seeds, serve_max_tokens new tokens each) against the same generations run in this
             process, one model.generate after another: requests/s and tokens/s, the wall-time ratio
             (the server's overhead), and CPU seconds (the server's from /proc, the client's and the
             in-process model's from this process), which a loaded machine disturbs less than wall time.
  speedrun   training time to a target val loss (the whole val split, core.evaluate.evaluate_split): nanoGPT's
             model and plain loop (speedrun_base: GPT-2, its AdamW fused only on CUDA, its cosine schedule)
             against ours (speedrun_base + speedrun_ours: config/modern.py's model, core.optim's optimizer and
             schedule). Both read batches as nanoGPT does, from a generator of their own seeded alike. The
             runs take turns of speedrun_chunk iterations, so that load from other processes hits both, and
             are scored every speedrun_eval_every iterations, every speedrun_eval_fine once near the target;
             a run is done at its first score at or below the target. Per run: iterations, tokens, training
             wall seconds and this process's CPU seconds to the target (evaluation time apart), and the
             ratio to nanoGPT's, per seed and as the mean over seeds. The default target is nanoGPT's val loss
             after speedrun_target_iters (SPEEDRUN_TARGETS; measured first when none is recorded, as for the
             gpt2 preset, which races GPT-2 small's shape on a GPU).
"""
import contextlib
import dataclasses
import datetime
import io
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from core import checkpoint, flops, memory, optim, parallel, runtime
from core.markdown import table
from core.config import apply_overrides, parse_args, read_config_file, to_dict
from core.prepare import TextPrepareConfig, prepare_text_corpus
from core.errors import UserError, first_line, run_cli
from core.fileio import write_json
from core.tokenizer import CharTokenizer, GPT2Tokenizer
from core.train_config import TrainConfig, get_lr, local_accum_steps, make_optimizer
from model import GPT, GPT2_SHAPES, GPTConfig, scaled_dot_product_attention, window_shift

SECTIONS = ("train", "loop", "muon", "attention", "decode", "prepare", "rolling", "memory", "serve", "speedrun")
OOM = "OOM"  # a figure that did not fit in device memory
# THREADS: one torch thread by default. On a shared 2-core machine two OpenMP threads spin-wait for each
# other whenever another process holds a core, which makes the figures slower and erratic (docs/performance.md).
# On a machine of your own, --threads=0.
DEFAULT_CORPUS = "../shared/data/tinyshakespeare.txt"
TRAIN_PY = Path(__file__).resolve().parent / "train.py"
GENERATED_CHARS = 1_000_000  # the stand-in corpus when DEFAULT_CORPUS is absent: about Tiny Shakespeare's size
MiB = 2**20


@dataclasses.dataclass
class BenchConfig:
    preset: str = "cpu"        # "cpu": the defaults below; "gpt2": GPT-2 small sizes for a GPU (PRESETS)
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 1           # torch intra-op threads; 0 keeps torch's default (one per core). See THREADS.
    seed: int = 1337
    sections: str = "train,loop,muon,attention,decode,prepare,rolling,memory,serve"
    out: str = "bench.json"
    warmup: int = 1            # untimed runs before each timed figure
    repeats: int = 3           # timed runs; each figure is their median
    # 1. training step: the baby GPT (data/shakespeare_char, 65 characters) at batch 4
    batch_size: int = 4
    block_size: int = 256      # 4 batch * 256 context = 1,024 tokens per step
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    vocab_size: int = 65
    bias: bool = False
    compile: bool = True
    # 1b. train.py's iteration against a plain loop: this config file's model, batch and optimizer
    loop_config: str = "config/train_shakespeare_char_cpu.py"
    loop_steps: int = 20       # iterations per timed chunk; `repeats` chunks of each, alternating
    recipe_config: str = "config/modern.py"  # timed beside them: train.py with this file after loop_config
    # 1c. Muon's step alone, on the hidden matrices of loop_config + recipe_config's model
    muon_shape: str = ""       # key=value pairs on that model, e.g. "n_layer=2,n_head=12,n_embd=768" (GPT-2's width)
    # 2. attention memory: one layer's attention of the same model, B=1, over a range of T
    attn_batch_size: int = 1
    attn_n_head: int = 6
    attn_head_size: int = 64
    attn_lengths: str = "256,512,1024,2048,4096"
    attn_repeats: int = 1      # memory is deterministic for a given allocator; more repeats only cost time
    # 3. decoding: the baby GPT's shape (6 layers, 384 wide, 6 heads, 256-token context)
    decode_n_layer: int = 6
    decode_n_head: int = 6
    decode_n_embd: int = 384
    decode_block_size: int = 256
    decode_vocab_size: int = 65
    decode_batch_size: int = 1
    decode_contexts: str = "64,128,256"
    gen_prompt_len: int = 1    # generate(): a 1-token prompt, like sample.py's default start
    gen_new_tokens: int = 500
    gen_window_shift: int | None = None  # past the context the window jumps this far at once; None: sample.py's
                                         # default (block_size // 2); 1: nanoGPT's rule (every step a full forward)
    gen_repeats: int = 1       # a no-cache run of 500 tokens takes about a minute on 2 CPU cores
    roll_new_tokens: int = 48  # rolling: tokens decoded past the context, each way
    # 4. data preparation
    corpus: str | None = None  # a text file; None: DEFAULT_CORPUS if it exists, else a generated text
    # 5. serving: serve.py over HTTP against the same generations in-process, on the decode section's model
    serve_clients: str = "1,4,16"  # concurrent clients, one request each
    serve_max_tokens: int = 64     # new tokens per request (sampled, temperature 1, no stop: always this many)
    serve_prompt_len: int = 16
    # 6. speedrun: training time to a target val loss, nanoGPT's model and loop against our recipe
    speedrun_base: str = "config/train_shakespeare_char_cpu.py"  # nanoGPT's run; ours starts from it too
    # ours: config files and key=value pairs, comma-separated, after the base: the modern recipe with its
    # schedule sized to the race, a 20-iteration warm-up and AdamW (embeddings, head, gains) at 4x the base
    # rate: 440 -> 320 iterations to the target, 320 at both seeds measured (docs/speedrun.md)
    speedrun_ours: str = "config/modern.py,max_iters=400,lr_decay_iters=400,warmup_iters=20,learning_rate=4e-3"
    speedrun_shape: str = ""   # key=value pairs applied to every run last (the gpt2 preset: GPT-2 small's shape)
    speedrun_runs: str = "nanogpt,ours"  # which runs race; ratios are to the first
    speedrun_seeds: str = "1337"         # one race per seed, each run seeded alike (weights and batches)
    target: float | None = None          # val loss to reach; None: SPEEDRUN_TARGETS, or measured first
    speedrun_target_iters: int = 2000    # the default target is nanoGPT's val loss after this many iterations
    speedrun_measure_target: bool = False  # measure the default target now, even where one is recorded
    speedrun_eval_every: int = 100       # whole-val-split evaluation every N iterations ...
    speedrun_eval_fine: int = 20         # ... and every M once within speedrun_eval_margin of the target
    speedrun_eval_margin: float = 0.03
    speedrun_eval_batch: int = 64        # windows of block_size per evaluation forward
    speedrun_chunk: int = 50             # iterations per turn; the runs take turns until each is done
    speedrun_max_iters_factor: float = 1.5  # a run stops unreached after this times its config's max_iters
    speedrun_data_dir: str = ""          # a prepared dataset; "": quick-start characters built from the corpus
    speedrun_log_dir: str = ""           # also write <dir>/<seed>/<run>/log.jsonl + config.json (plot.py reads them)

    def check(self) -> None:
        unknown = set(section_list(self)) - set(SECTIONS)
        if unknown:
            raise UserError(f"--sections: unknown {', '.join(sorted(unknown))}; use some of {','.join(SECTIONS)}")
        for key in ("warmup", "threads"):
            if getattr(self, key) < 0:
                raise UserError(f"{key} must be >= 0, got {getattr(self, key)}")
        for key in ("repeats", "attn_repeats", "gen_repeats", "gen_prompt_len", "gen_new_tokens", "loop_steps",
                    "roll_new_tokens", "serve_max_tokens", "serve_prompt_len", "speedrun_target_iters",
                    "speedrun_eval_every", "speedrun_eval_fine", "speedrun_eval_batch", "speedrun_chunk"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        int_list(self.attn_lengths, "attn_lengths")
        int_list(self.serve_clients, "serve_clients")
        if "serve" in section_list(self) and self.serve_prompt_len > self.decode_block_size:
            raise UserError(f"serve_prompt_len {self.serve_prompt_len} is longer than "
                            f"decode_block_size {self.decode_block_size}")
        int_list(self.speedrun_seeds, "speedrun_seeds")
        runs = spec_list(self.speedrun_runs)
        if not runs or set(runs) - set(SPEEDRUN_RUNS) or len(set(runs)) != len(runs):
            raise UserError(f"speedrun_runs must list some of {','.join(SPEEDRUN_RUNS)} once each, got "
                            f"'{self.speedrun_runs}'")
        if not self.speedrun_max_iters_factor >= 1 or self.speedrun_eval_margin < 0:
            raise UserError(f"need speedrun_max_iters_factor >= 1 and speedrun_eval_margin >= 0, got "
                            f"{self.speedrun_max_iters_factor}, {self.speedrun_eval_margin}")
        contexts = int_list(self.decode_contexts, "decode_contexts")
        if max(contexts) > self.decode_block_size:
            raise UserError(f"decode_contexts go up to {max(contexts)}, "
                            f"past decode_block_size {self.decode_block_size}")
        if self.gen_window_shift is not None and not 1 <= self.gen_window_shift <= self.decode_block_size:
            raise UserError(f"gen_window_shift must be in [1, decode_block_size={self.decode_block_size}] or None, "
                            f"got {self.gen_window_shift}")
        if self.gen_prompt_len > self.decode_block_size:
            raise UserError(f"gen_prompt_len {self.gen_prompt_len} is longer than "
                            f"decode_block_size {self.decode_block_size}")
        for name, (n_embd, n_head) in {"": (self.n_embd, self.n_head),
                                       "decode_": (self.decode_n_embd, self.decode_n_head)}.items():
            if n_embd % n_head:
                raise UserError(f"{name}n_embd ({n_embd}) must be divisible by {name}n_head ({n_head})")


PRESETS = {
    "cpu": {},
    # GPT-2 small (124M) in its own vocabulary; attention to 16k; decoding GPT-2 small to its 1024 context.
    "gpt2": dict(
        batch_size=8, block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_size=50304, bias=True,
        warmup=3, repeats=10,
        attn_n_head=12, attn_lengths="256,512,1024,2048,4096,8192,16384", attn_repeats=3,
        decode_n_layer=12, decode_n_head=12, decode_n_embd=768, decode_block_size=1024, decode_vocab_size=50304,
        decode_contexts="128,256,512,1024", gen_repeats=3, threads=0, loop_config="config/train_shakespeare_char.py",
        # the speedrun at GPT-2 small's shape on the character data (its target is measured first: none recorded)
        speedrun_shape="n_layer=12,n_head=12,n_embd=768,block_size=1024,batch_size=16,learning_rate=6e-4,min_lr=6e-5",
    ),
}


def load_config(argv: Sequence[str]) -> BenchConfig:
    """Defaults, then the preset, then config files and --key=value: what you pass beats the preset."""
    cfg = parse_args(BenchConfig, argv)  # checks every key and type, and finds the preset
    if cfg.preset not in PRESETS:
        raise UserError(f"unknown preset '{cfg.preset}'; use one of {', '.join(PRESETS)}")
    given = set()
    for arg in argv:
        given |= {arg[2:].partition("=")[0]} if arg.startswith("--") else set(read_config_file(arg))
    preset = {key: value for key, value in PRESETS[cfg.preset].items() if key not in given}
    cfg = apply_overrides(cfg, preset, f"preset {cfg.preset}")
    cfg.check()
    return cfg


def int_list(text: str, key: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{key} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise UserError(f"{key} must list positive integers, got '{text}'")
    return values


def section_list(cfg: BenchConfig) -> list[str]:
    return [s.strip() for s in cfg.sections.split(",") if s.strip()]


# ---------------------------------------------------------------------------------------------
# measuring


def median_time(fn: Callable[[], object], warmup: int, repeats: int,
                synchronize: Callable[[], None] = lambda: None) -> float:
    """Median seconds of `repeats` calls of fn, after `warmup` untimed calls.

    synchronize waits for queued device work (GPU kernels run asynchronously), so each time
    covers the work fn launched, not just the launching.
    """
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


def cuda_peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated while fn runs, above what was allocated when it started (bytes)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def cpu_peak_extra_bytes(runs: dict[str, Callable[[], object]]) -> dict[str, int]:
    """For each named run: peak CPU memory allocated while it runs, above what was allocated when it started.

    With profile_memory=True, torch.profiler records every allocation and free of torch's CPU
    allocator (kernels' scratch buffers included) as a "[memory]" event of +/- bytes; their running
    sum in time order is the memory held. The runs share one profile, each inside a record_function
    window named after it (every profiler start and stop logs a line to stderr). The per-op
    summaries lose the order of events, so this reads the raw event list.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, fn in runs.items():
            with torch.profiler.record_function(name):
                fn()
    events = prof.profiler.kineto_results.events()
    windows = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in runs}
    allocs = sorted(((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"), key=lambda m: m[0])
    peaks = {}
    for name, (start, end) in windows.items():
        before = sum(n for t, n in allocs if t < start)
        running = peak = before
        for t, n in allocs:
            if start <= t <= end:
                running += n
                peak = max(peak, running)
        peaks[name] = peak - before
    return peaks


def or_oom(fn: Callable[[], object], rt: runtime.Runtime):
    """fn(), or OOM when it runs out of device memory: one figure lost, not the whole run."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()
        return OOM


# ---------------------------------------------------------------------------------------------
# 5. memory: ddp against fsdp per process, activation checkpointing


MEMORY_WORLD_SIZES = (1, 2, 4)


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
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    x = torch.randint(mc.vocab_size, (batch_size, mc.block_size), generator=torch.Generator().manual_seed(rank))
    wrapped(x, x)[1].backward()
    optimizer.step()
    write_json(Path(out_dir) / f"{rank}.json", parallel.state_bytes(model, optimizer))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def spawned_state_bytes(how: str, world_size: int, mc: GPTConfig, batch_size: int) -> list[dict]:
    """Each process's parameter, gradient and optimizer bytes after one step, in `world_size` gloo processes."""
    with tempfile.TemporaryDirectory() as tmp:
        args = (world_size, f"{tmp}/store", how, mc, batch_size, tmp)
        if world_size == 1:  # plain training, no process group: run it here
            threads = torch.get_num_threads()
            _memory_worker(0, *args)
            torch.set_num_threads(threads)
        else:
            torch.multiprocessing.spawn(_memory_worker, nprocs=world_size, args=args)
        return [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world_size)]


def bench_memory(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    mc = GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                   n_embd=cfg.n_embd, dropout=0.0, bias=cfg.bias)
    state = []
    for how in parallel.PARALLELS:
        for n in MEMORY_WORLD_SIZES:
            ranks = spawned_state_bytes(how, n, mc, cfg.batch_size)
            state.append({"parallel": how, "processes": n, "per_rank": ranks,
                          **{k: max(r[k] for r in ranks) for k in ("params", "grads", "optimizer")}})
    result = {"model": model_text(mc, cfg.batch_size), "state": state,
              "checkpointing": activation_checkpointing_rows(cfg, rt, mc),
              "fits": fits_rows(FITS_MICRO_BATCH, FITS_WORLD_SIZE)}
    return result


def activation_checkpointing_rows(cfg: BenchConfig, rt: runtime.Runtime, mc: GPTConfig) -> list[dict]:
    """Peak memory above the weights and step time of forward + backward, without and with checkpointing."""
    torch.manual_seed(cfg.seed)
    models = {"off": GPT(mc).to(rt.device), "on": GPT(mc).to(rt.device)}
    models["on"].load_state_dict(models["off"].state_dict())
    parallel.apply_activation_checkpointing(models["on"])
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randint(mc.vocab_size, (cfg.batch_size, mc.block_size), generator=gen).to(rt.device)

    def step(m: GPT) -> Callable[[], None]:
        def run():
            with rt.autocast():
                _, loss = m(x, x)
            loss.backward()
            m.zero_grad(set_to_none=True)  # grads freed: the peak is activations (+ transient gradients)
        return run

    if rt.device_type == "cuda":
        peaks = {k: cuda_peak_extra_bytes(step(m)) for k, m in models.items()}
    else:
        peaks = cpu_peak_extra_bytes({k: step(m) for k, m in models.items()})
    return [{"activation_checkpointing": k, "peak_bytes": peaks[k],
             "step_s": median_time(step(m), cfg.warmup, cfg.repeats, rt.synchronize)} for k, m in models.items()]


GPU_GB = (24, 80, 141)
FITS_MICRO_BATCH, FITS_WORLD_SIZE = 4, 8  # sequences of 1024 tokens per GPU; GPUs sharing the model under fsdp


def fits_rows(micro_batch: int, world_size: int) -> list[dict]:
    """Computed: GB per GPU for each GPT-2 size, ddp and fsdp over world_size GPUs, and where it fits."""
    rows = []
    for name, shape in GPT2_SHAPES.items():
        config = GPTConfig(**shape)
        for how in parallel.PARALLELS:
            need = {ac: memory.gpu_training_memory(config, how, world_size, micro_batch, ac).total / 1e9
                    for ac in (False, True)}
            fits = ["yes" if need[False] <= memory.FITS_FRACTION * gb else
                    "with AC" if need[True] <= memory.FITS_FRACTION * gb else "no" for gb in GPU_GB]
            rows.append({"model": name, "params": memory.parameter_count(config), "parallel": how, "gb": need[False],
                         "gb_checkpointed": need[True], "fits": dict(zip(map(str, GPU_GB), fits))})
    return rows


# ---------------------------------------------------------------------------------------------
# 1. training step


def model_text(c: GPTConfig, batch_size: int) -> str:
    return (f"{c.n_layer} layers, {c.n_embd} wide, {c.n_head} heads, block_size {c.block_size}, "
            f"vocab {c.vocab_size}, batch {batch_size}")


def bench_train(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    torch.manual_seed(cfg.seed)
    mc = GPTConfig(block_size=cfg.block_size, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                   n_embd=cfg.n_embd, dropout=0.0, bias=cfg.bias)
    model = GPT(mc).to(rt.device)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), rt.device_type)
    scaler = rt.grad_scaler()
    gen = torch.Generator().manual_seed(cfg.seed)
    x, y = (torch.randint(mc.vocab_size, (cfg.batch_size, mc.block_size), generator=gen).to(rt.device)
            for _ in range(2))

    def step(m: torch.nn.Module) -> None:
        with rt.autocast():
            loss = m(x, y)[1]  # as train.py: the logits are not held through backward
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    peak, peak_source = flops.peak_flops_with_source(rt)
    tokens = cfg.batch_size * mc.block_size

    def row(mode: str, m: torch.nn.Module, build_s: float | None = None) -> dict:
        if rt.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        dt = or_oom(lambda: median_time(lambda: step(m), cfg.warmup, cfg.repeats, rt.synchronize), rt)
        if dt == OOM:
            optimizer.zero_grad(set_to_none=True)
            return {"mode": mode, "error": OOM}
        r = {"mode": mode, "step_s": dt, "tokens_per_s": tokens / dt,
             "mfu": model.estimate_mfu(cfg.batch_size, dt, peak) if peak else None}
        if build_s is not None:
            r["build_s"] = build_s
        if rt.device_type == "cuda":
            r["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        return r

    rows = [row("eager", model)]
    if cfg.compile:
        try:
            compiled = torch.compile(model)
            t0 = time.perf_counter()
            if or_oom(lambda: step(compiled), rt) == OOM:  # the first call traces and builds the kernels
                rows.append({"mode": "compiled", "error": OOM})
            else:
                rt.synchronize()
                rows.append(row("compiled", compiled, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - any compiler failure is a result to report, not a crash
            rows.append({"mode": "compiled", "error": f"compile failed: {type(e).__name__}: {first_line(e)}"})
    result = {"model": model_text(mc, cfg.batch_size), "params": model.get_num_params(),
              "tokens_per_step": tokens, "flops_per_token": model.flops_per_token(),
              "peak_flops": peak, "peak_flops_source": peak_source, "rows": rows}
    if len(rows) == 2 and "error" not in rows[0] and "error" not in rows[1]:
        result["compiled_over_eager"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    return result


# ---------------------------------------------------------------------------------------------
# 1b. train.py's iteration against a plain training loop


def loop_dataset(out_dir: Path) -> tuple[str, int]:
    """A character dataset of DEFAULT_CORPUS (or a generated text) in out_dir; (its source, vocab size)."""
    from core.prepare import write_dataset
    from core.tokenizer import CharTokenizer

    if Path(DEFAULT_CORPUS).is_file():
        text, source = Path(DEFAULT_CORPUS).read_text(encoding="utf-8"), DEFAULT_CORPUS
    else:
        text, source = generated_text(GENERATED_CHARS), "generated text"
    tok = CharTokenizer.from_text(text)
    n = int(0.9 * len(text))
    meta = write_dataset(out_dir, tok.meta(), {"train": tok.encode(text[:n]), "val": tok.encode(text[n:])})
    return source, meta["vocab_size"]


def nanogpt_batch(path: Path, block_size: int, batch_size: int, device: str,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: a fresh memmap, random starts from `generator` (torch's global one when None)."""
    import numpy as np

    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def bench_loop(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    """ms per iteration: train.py itself (run as a user runs it; the "ms" its log.jsonl records for each
    step) and a plain loop in this process, same model, data, optimizer and threads, in alternating chunks."""
    if rt.ddp:
        raise UserError("the loop section runs on one process; start bench.py without torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        source, vocab = loop_dataset(Path(tmp))
        overrides = read_config_file(cfg.loop_config) | dict(data_dir=tmp, device=rt.device, dtype=rt.dtype,
                                                             out_dir=str(Path(tmp) / "out"), vocab_size=vocab)
        tcfg = apply_overrides(TrainConfig(), overrides, cfg.loop_config)
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig(**tcfg.model_args(), vocab_size=vocab)).to(rt.device).train()
        groups = model.configure_optimizers(tcfg.weight_decay, tcfg.learning_rate, (tcfg.beta1, tcfg.beta2),
                                            rt.device_type).param_groups
        # nanoGPT's optimizer: AdamW, fused only on CUDA (the per-tensor loop elsewhere)
        optimizer = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                                      lr=tcfg.learning_rate, betas=(tcfg.beta1, tcfg.beta2),
                                      fused=rt.device_type == "cuda")
        accum, state = local_accum_steps(tcfg, 1), {"it": 0, "timed": []}
        warm = max(1, cfg.warmup) * 2

        def ours(n: int, *recipe: str) -> float:
            """ms per step of train.py's steps after `warm` untimed ones, from its log.jsonl; `recipe`: config
            files read after loop_config."""
            out = Path(tmp) / ("out-recipe" if recipe else "out")
            run = overrides | dict(max_iters=warm + n, log_interval=1, eval_interval=warm + n + 1, eval_iters=1,
                                   compile=False, seed=cfg.seed, out_dir=str(out), overwrite=True)  # each chunk anew
            argv = [f"--{k}={v}" for k, v in run.items()]
            env = os.environ | {"OMP_NUM_THREADS": str(torch.get_num_threads()),
                                "MKL_NUM_THREADS": str(torch.get_num_threads())}
            done = subprocess.run([sys.executable, str(TRAIN_PY), cfg.loop_config, *recipe, *argv], env=env,
                                  capture_output=True, text=True)
            if done.returncode:
                raise UserError(f"train.py failed in the loop section: {(done.stderr.strip() or '?').splitlines()[-1]}")
            ms = [r["ms"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "ms" in r]
            if not recipe:
                state["timed"].append(len(ms[warm:]))
            return statistics.fmean(ms[warm:]) / 1e3

        def set_lr(it: int) -> None:  # nanoGPT's: every group at the schedule's rate
            for group in optimizer.param_groups:
                group["lr"] = get_lr(it, tcfg)
        train_bin = Path(tmp) / "train.bin"
        step = plain_step(model, optimizer, lambda: nanogpt_batch(train_bin, tcfg.block_size, tcfg.batch_size,
                                                                  rt.device), tcfg, rt, set_lr)

        def plain(n: int) -> float:
            rt.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                it = state["it"]
                loss = step(it)
                if it % tcfg.log_interval == 0:
                    loss.item()  # nanoGPT's logging sync
                state["it"] += 1
            rt.synchronize()
            return (time.perf_counter() - t0) / n

        plain(warm)
        times = {"plain": [], "train_py": [], "recipe": []}
        for _ in range(cfg.repeats):  # alternating, so that load from other processes hits all alike
            times["plain"].append(plain(cfg.loop_steps))
            times["train_py"].append(ours(cfg.loop_steps))
            times["recipe"].append(ours(cfg.loop_steps, cfg.recipe_config))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"config": cfg.loop_config, "corpus": source, "model": model_text(model.config, tcfg.batch_size),
            "accum": accum, "steps_per_chunk": cfg.loop_steps, "chunks": cfg.repeats,
            "plain_ms": ms["plain"], "train_py_ms": ms["train_py"], "train_py_over_plain": ms["train_py"] / ms["plain"],
            "recipe_config": cfg.recipe_config, "recipe_ms": ms["recipe"],
            # each chunk against the classic chunk run just before it: load that changes over the run cancels
            "recipe_over_train_py": statistics.median(r / c for r, c in zip(times["recipe"], times["train_py"])),
            "muon_newton_schulz": "bfloat16" if runtime.native_bf16(rt.device) else "float32",
            "chunk_ms": {name: [t * 1e3 for t in ts] for name, ts in times.items()}, "train_py_steps": state["timed"]}


# ---------------------------------------------------------------------------------------------
# 1c. Muon's step alone

MUON_STEPS = {  # what core.optim.build_optimizer chooses between, per device
    "torch.optim.Muon, bf16": (torch.optim.Muon, {}),
    "BatchedMuon, bf16": (optim.BatchedMuon, {"ns_dtype": torch.bfloat16}),
    "BatchedMuon, float32": (optim.BatchedMuon, {"ns_dtype": torch.float32}),
}


def bench_muon(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    """ms per Muon step (momentum, Newton-Schulz, update) of each implementation on the same fixed gradients."""
    tcfg = read_recipe([cfg.loop_config, cfg.recipe_config, *spec_list(cfg.muon_shape)], "--muon_shape")
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**tcfg.model_args(), vocab_size=65)).to(rt.device)  # the vocab only sizes wte and the head
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    chosen = optim.build_optimizer(model, "muon", tcfg.learning_rate, 0.0, (0.9, 0.95), rt.device_type).optimizers["muon"]
    hidden = [p for _, p in optim.split_params(model)["hidden"]]
    rows = []
    for name, (muon_class, kwargs) in MUON_STEPS.items():
        opt = muon_class(hidden, lr=tcfg.muon_lr, momentum=tcfg.muon_momentum, adjust_lr_fn="original",
                         ns_steps=tcfg.muon_ns_steps, **kwargs)
        rows.append({"muon": name, "step_ms": median_time(opt.step, cfg.warmup, cfg.repeats, rt.synchronize) * 1e3,
                     "chosen": type(chosen) is muon_class and getattr(chosen, "ns_dtype", None) == kwargs.get("ns_dtype")})
    return {"model": model_text(model.config, tcfg.batch_size), "matrices": len(hidden),
            "shapes": sorted({tuple(p.shape) for p in hidden}), "native_bf16": runtime.native_bf16(rt.device),
            "rows": rows}


# ---------------------------------------------------------------------------------------------
# 2. attention memory


def naive_attention(q, k, v):
    return scaled_dot_product_attention(q, k, v, causal=True)  # the reference: forms (B, nh, T, T)


def fused_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # what the sdpa backend calls for a full block


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
    run = attention_run(fused_attention, shape, rt, backward=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    kernels = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention")
    names = {e.name for e in prof.events() if e.name.startswith(kernels)}
    return ", ".join(sorted(names)) or "unknown"


def bench_attention(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    lengths = int_list(cfg.attn_lengths, "attn_lengths")
    B, nh, hs = cfg.attn_batch_size, cfg.attn_n_head, cfg.attn_head_size
    itemsize = torch.empty(0, dtype=rt.ptdtype).element_size()
    variants = {f"{name}_{mode}_bytes": (attn, mode == "forward_backward")
                for name, attn in (("naive", naive_attention), ("sdpa", fused_attention))
                for mode in ("forward", "forward_backward")}
    for attn, backward in variants.values():  # warm-up: one-time buffers (thread pools, kernels) are not attention's
        or_oom(lambda: attention_run(attn, (B, nh, min(lengths), hs), rt, backward)(), rt)
    runs = {f"{key} T={T} #{i}": or_oom(lambda: attention_run(attn, (B, nh, T, hs), rt, backward), rt)
            for T in lengths for key, (attn, backward) in variants.items() for i in range(cfg.attn_repeats)}
    runs = {name: (lambda: OOM) if run == OOM else run for name, run in runs.items()}  # its inputs did not fit
    if rt.device_type == "cuda":
        peaks = {name: or_oom(lambda: cuda_peak_extra_bytes(run), rt) for name, run in runs.items()}
        method = "torch.cuda.max_memory_allocated above memory_allocated before the call"
    elif rt.device_type == "cpu":
        out_of_memory = set()

        def guarded(name: str, run: Callable[[], None]) -> Callable[[], None]:
            return lambda: or_oom(run, rt) == OOM and out_of_memory.add(name)
        peaks = cpu_peak_extra_bytes({name: guarded(name, run) for name, run in runs.items()})
        peaks |= {name: OOM for name in out_of_memory}
        method = "torch.profiler(profile_memory=True): the CPU allocator's alloc/free events summed in time order"
    else:
        raise UserError(f"attention memory is measured on cuda or cpu, not {rt.device_type}; "
                        f"leave attention out of --sections there")
    del runs
    rows = []
    for T in lengths:
        row = {"T": T, "score_matrix_bytes": B * nh * T * T * itemsize}
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
        span = math.log(last["T"] / first["T"])
        result["growth_exponent"] = {  # memory ~ T^exponent between the shortest and the longest T
            key: math.log(last[key] / first[key]) / span for key in variants}
    return result


# ---------------------------------------------------------------------------------------------
# 3. decoding


def token_times(model: GPT, prompt: torch.Tensor, new_tokens: int, use_cache: bool, shift: int,
                rt: runtime.Runtime) -> list[float]:
    """Seconds until each new token of a greedy generate_stream run was ready, token by token."""
    times = []
    t0 = time.perf_counter()
    for _ in model.generate_stream(prompt, new_tokens, temperature=0.0, use_cache=use_cache, window_shift=shift):
        rt.synchronize()
        t = time.perf_counter()
        times.append(t - t0)
        t0 = t
    return times


def bench_decode(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    torch.manual_seed(cfg.seed)
    mc = GPTConfig(block_size=cfg.decode_block_size, vocab_size=cfg.decode_vocab_size, n_layer=cfg.decode_n_layer,
                   n_head=cfg.decode_n_head, n_embd=cfg.decode_n_embd, dropout=0.0, bias=cfg.bias)
    model = runtime.inference_model(GPT(mc), rt)  # as sample.py: weights cast once, float32 next-token logits
    B = cfg.decode_batch_size
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(mc.vocab_size, (B, mc.block_size), generator=gen).to(rt.device)  # (B, block_size)

    rows = []
    with torch.no_grad():
        cache = or_oom(lambda: model.new_kv_cache(B), rt)
        for C in int_list(cfg.decode_contexts, "decode_contexts"):
            rows.append(or_oom(lambda: decode_row(cfg, model, tokens, cache, C, rt), rt))
            if rows[-1] == OOM:
                rows[-1] = {"context": C, "error": OOM}
    generation = or_oom(lambda: bench_generation(cfg, model, tokens[:, :cfg.gen_prompt_len], rt), rt)
    return {"model": model_text(mc, B), "params": model.get_num_params(), "rows": rows,
            "generation": {"error": OOM} if generation == OOM else generation}


def decode_row(cfg: BenchConfig, model: GPT, tokens: torch.Tensor, cache, C: int, rt: runtime.Runtime) -> dict:
    """Latency of the step that reads C tokens and predicts the next, without and with the KV cache."""
    B = tokens.size(0)
    no_cache_s = median_time(lambda: model(tokens[:, :C], last_only=True), cfg.warmup, cfg.repeats, rt.synchronize)
    cache.reset()
    if C > 1:
        model(tokens[:, :C - 1], kv_cache=cache, last_only=True)  # the cache holds the first C - 1 tokens

    def cached_step() -> None:
        cache.pos = C - 1  # the explicit position: token C goes in at C - 1, every time
        model(tokens[:, C - 1:C], kv_cache=cache, last_only=True)
    cache_s = median_time(cached_step, cfg.warmup, cfg.repeats, rt.synchronize)
    return {"context": C, "no_cache_ms": no_cache_s * 1e3, "cache_ms": cache_s * 1e3,
            "no_cache_tokens_per_s": B / no_cache_s, "cache_tokens_per_s": B / cache_s,
            "speedup": no_cache_s / cache_s}


def bench_generation(cfg: BenchConfig, model: GPT, prompt: torch.Tensor, rt: runtime.Runtime) -> dict:
    """generate() end to end, as sample.py calls it, cache against no cache, split where the window first moves.

    Once prompt + generated tokens pass block_size the window of tokens the model sees moves on, by
    window_shift tokens at a time. With learned positions every cached key is then stale, so the cache
    is refilled at each move: with window_shift=1 every step past the context is a full forward,
    cache or not; with block_size // 2 (sample.py's default) one refill serves block_size // 2 tokens.
    """
    P, N, block = prompt.size(1), cfg.gen_new_tokens, model.config.block_size
    shift = window_shift(cfg.gen_window_shift, block)
    inside = min(N, block - P + 1)  # tokens sampled while the whole sequence still fits the window
    for use_cache in (False, True):  # warm-up: a few tokens each way
        token_times(model, prompt, min(N, 4), use_cache, shift, rt)
    runs = {mode: [token_times(model, prompt, N, use_cache, shift, rt) for _ in range(cfg.gen_repeats)]
            for mode, use_cache in (("no_cache", False), ("cache", True))}
    spans = {"inside_context": (0, inside), "past_context": (inside, N), "all": (0, N)}
    if inside == N:  # everything fits the window: the other two rows would be empty or repeat this one
        spans = {"inside_context": (0, N)}
    parts = {}
    for name, (lo, hi) in spans.items():
        part = {"tokens": hi - lo}
        for mode, mode_runs in runs.items():
            part[f"{mode}_s"] = statistics.median(sum(run[lo:hi]) for run in mode_runs)
            part[f"{mode}_tokens_per_s"] = (hi - lo) * prompt.size(0) / part[f"{mode}_s"]
        part["speedup"] = part["no_cache_s"] / part["cache_s"]
        parts[name] = part
    return {"prompt_tokens": P, "new_tokens": N, "block_size": block, "window_shift": shift,
            "repeats": cfg.gen_repeats, "parts": parts}


def bench_rolling(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    """ms per token past the context, the window sliding one token per step, three ways; and the cached
    step inside the context, the speed the rolling cache should keep."""
    ways = {"learned, cache refilled": ("learned", False), "rope, cache refilled": ("rope", False),
            "rope, rolling cache": ("rope", True)}
    base = GPTConfig(block_size=cfg.decode_block_size, vocab_size=cfg.decode_vocab_size, n_layer=cfg.decode_n_layer,
                     n_head=cfg.decode_n_head, n_embd=cfg.decode_n_embd, dropout=0.0, bias=cfg.bias)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(base.vocab_size, (cfg.decode_batch_size, base.block_size), generator=gen).to(rt.device)
    rows = []
    for name, (pos, rolling) in ways.items():
        torch.manual_seed(cfg.seed)
        model = GPT(dataclasses.replace(base, pos_embedding=pos)).to(rt.device).eval()

        def decode(n: int) -> list[float]:
            times, t0 = [], time.perf_counter()
            with rt.autocast():
                for _ in model.generate_stream(prompt, n, temperature=0.0, window_shift=1, rolling_cache=rolling):
                    rt.synchronize()
                    times.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
            return times[1:]  # the first token pays for the prefill
        decode(3)  # warm-up
        per_token = statistics.median(decode(cfg.roll_new_tokens + 1))
        rows.append({"way": name, "ms_per_token": per_token * 1e3, "tokens_per_s": cfg.decode_batch_size / per_token})
    # The yardstick: the same rope model's cached step inside the context, the cache holding block_size - 1 keys.
    with torch.no_grad(), rt.autocast():
        cache = model.new_kv_cache(cfg.decode_batch_size)
        model(prompt[:, :-1], kv_cache=cache)

        def cached_step() -> None:
            cache.pos = base.block_size - 1
            model(prompt[:, -1:], kv_cache=cache)
        per_token = median_time(cached_step, cfg.warmup, cfg.roll_new_tokens, rt.synchronize)
    rows.append({"way": "rope, cached step inside the context", "ms_per_token": per_token * 1e3,
                 "tokens_per_s": cfg.decode_batch_size / per_token})
    return {"model": model_text(base, cfg.decode_batch_size), "new_tokens": cfg.roll_new_tokens, "rows": rows}


# ---------------------------------------------------------------------------------------------
# 4. data preparation


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


def bench_prepare(cfg: BenchConfig) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.corpus is not None:
            if not Path(cfg.corpus).is_file():
                raise UserError(f"--corpus file '{cfg.corpus}' not found")
            path, source = Path(cfg.corpus), cfg.corpus
        elif Path(DEFAULT_CORPUS).is_file():
            path, source = Path(DEFAULT_CORPUS), DEFAULT_CORPUS
        else:
            path, source = Path(tmp) / "generated.txt", f"generated text ({DEFAULT_CORPUS} not found)"
            path.write_text(generated_text(GENERATED_CHARS), encoding="utf-8")
        prep = TextPrepareConfig(input=str(path), out_dir=str(Path(tmp) / "out"))

        def run() -> dict:
            with contextlib.redirect_stdout(io.StringIO()):  # its one-line summary would break the tables
                return prepare_text_corpus(prep, lambda text: GPT2Tokenizer(), __file__)

        meta = run()  # the first run is a warm-up too: it reads the file into the page cache
        dt = median_time(run, max(0, cfg.warmup - 1), cfg.repeats)
        chars = len(path.read_text(encoding="utf-8"))
    tokens = meta["train_tokens"] + meta["val_tokens"]
    return {"corpus": source, "path": "core.prepare.prepare_text_corpus + GPT2Tokenizer (data/shakespeare/prepare.py)",
            "chars": chars, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


# ---------------------------------------------------------------------------------------------
# 5. serving: serve.py over HTTP against the same generations in-process


def serve_checkpoint(cfg: BenchConfig, out_dir: Path) -> tuple[GPT, CharTokenizer, str]:
    """The decode section's model (random weights) saved as a checkpoint serve.py can load, with a character
    vocabulary of decode_vocab_size stand-in characters; returns the model, the tokenizer and a prompt."""
    torch.manual_seed(cfg.seed)
    mc = GPTConfig(block_size=cfg.decode_block_size, vocab_size=cfg.decode_vocab_size, n_layer=cfg.decode_n_layer,
                   n_head=cfg.decode_n_head, n_embd=cfg.decode_n_embd, dropout=0.0, bias=cfg.bias)
    model = GPT(mc)
    tok = CharTokenizer([chr(0x100 + i) for i in range(mc.vocab_size)])  # any distinct printable characters
    checkpoint.save_checkpoint(out_dir, {"model_args": dataclasses.asdict(mc), "tokenizer": tok.meta(), "iter_num": 0},
                               model.state_dict())
    prompt = tok.decode([i % mc.vocab_size for i in range(cfg.serve_prompt_len)])
    return model, tok, prompt


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) another process has used so far; None where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def start_server(cfg: BenchConfig, rt: runtime.Runtime, out_dir: Path, port: int):
    import httpx
    threads = str(cfg.threads or os.cpu_count())  # the same torch threads as this process
    env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    log = open(out_dir / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("serve.py")), f"--out_dir={out_dir}",
                             "--model_name=bench", f"--port={port}", f"--device={rt.device}", f"--dtype={rt.dtype}",
                             f"--max_tokens_limit={cfg.serve_max_tokens}", "--max_n=1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        time.sleep(0.2)
    proc.kill()
    raise UserError(f"serve.py did not start for the serve section:\n{(out_dir / 'serve.log').read_text()[-2000:]}")


def bench_serve(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    import asyncio

    import httpx
    clients = int_list(cfg.serve_clients, "serve_clients")
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, prompt = serve_checkpoint(cfg, Path(tmp))
        model = runtime.inference_model(model, rt)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_server(cfg, rt, Path(tmp), port)
        try:
            rows = []
            for c in clients:
                def in_process():  # what the server does for c requests, without HTTP: one generate each
                    ids = torch.tensor([tok.encode(prompt)], device=rt.device)  # (1, T)
                    for seed in range(c):
                        model.generate(ids, cfg.serve_max_tokens, temperature=1.0, vocab_size=tok.vocab_size,
                                       generator=torch.Generator(device=rt.device).manual_seed(seed),
                                       window_shift=window_shift(None, model.config.block_size))

                async def requests():
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                        replies = await asyncio.gather(*(client.post("/v1/completions", json={
                            "model": "bench", "prompt": prompt, "max_tokens": cfg.serve_max_tokens,
                            "temperature": 1.0, "seed": seed}) for seed in range(c)))
                    for r in replies:
                        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != cfg.serve_max_tokens:
                            raise UserError(f"serve.py answered {r.status_code}: {r.text[:300]}")

                row = {"clients": c, "tokens": c * cfg.serve_max_tokens}
                for way, fn in (("in_process", in_process), ("server", lambda: asyncio.run(requests()))):
                    cpu0, server0 = time.process_time(), process_cpu_s(server.pid)
                    row[f"{way}_s"] = median_time(fn, cfg.warmup, cfg.repeats, rt.synchronize)
                    runs = cfg.warmup + cfg.repeats
                    # this process's CPU: the model in-process; the HTTP client for the server
                    row["in_process_cpu_s" if way == "in_process" else "server_client_cpu_s"] = \
                        (time.process_time() - cpu0) / runs
                    if way == "server" and server0 is not None:
                        row["server_cpu_s"] = (process_cpu_s(server.pid) - server0) / runs
                rows.append(row | {"requests_per_s": c / row["server_s"],
                                   "tokens_per_s": row["tokens"] / row["server_s"],
                                   "in_process_tokens_per_s": row["tokens"] / row["in_process_s"],
                                   "overhead": row["server_s"] / row["in_process_s"]})
        finally:
            server.terminate()
            server.wait(60)
    mc = model.config
    return {"model": f"{mc.n_layer} layers x {mc.n_embd} wide, {mc.n_head} heads, block_size {mc.block_size}, "
                     f"vocab {mc.vocab_size}", "params": model.get_num_params(), "prompt_tokens": cfg.serve_prompt_len,
            "max_tokens": cfg.serve_max_tokens, "repeats": cfg.repeats, "rows": rows}


# ---------------------------------------------------------------------------------------------
# 6. speedrun: wall time to a target val loss, nanoGPT against our recipe


# The default target: the val loss (whole split) that nanoGPT's plain loop reaches at speedrun_target_iters with
# the default speedrun_base and no speedrun_shape, seed 1337, on the prepared quick-start data. Measured once with
#     python bench.py --sections=speedrun --speedrun_measure_target=True --speedrun_seeds=1337
SPEEDRUN_TARGETS = {("config/train_shakespeare_char_cpu.py", "", 2000): 1.8883}
SPEEDRUN_RUNS = ("nanogpt", "ours")


def read_recipe(specs: Sequence[str], source: str) -> TrainConfig:
    """train.py's config from config files and key=value pairs, applied in order as train.py applies them. The
    speedrun trains what it says (model, batch, optimizer, schedule); its I/O and device keys are not used."""
    try:
        return parse_args(TrainConfig, [f"--{spec}" if "=" in spec else spec for spec in specs])
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def tokens_per_iter(cfg: TrainConfig) -> int:
    return cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps


def spec_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


@dataclasses.dataclass
class Racer:
    """One run of the race: step(it) trains iteration it, evaluate() returns the whole-val-split loss, sync()
    waits for the device, log(record) keeps an evaluation. The rest is its record so far."""
    name: str
    step: Callable[[int], None]
    evaluate: Callable[[], float]
    max_iters: int  # the cap: a run that has not reached the target by then stops without it
    tokens_per_iter: int
    sync: Callable[[], None] = lambda: None
    log: Callable[[dict], None] = lambda record: None
    it: int = 0  # iterations trained
    train_wall_s: float = 0.0
    train_cpu_s: float = 0.0
    eval_wall_s: float = 0.0
    curve: list = dataclasses.field(default_factory=list)  # [iter, val loss, train wall s, train CPU s]
    reached: dict | None = None
    stopped: bool = False  # at the cap without reaching the target
    chunks: list = dataclasses.field(default_factory=list)  # (round, first iter, iter after the last)

    @property
    def done(self) -> bool:
        return self.reached is not None or self.stopped


def eval_due(it: int, curve: list, target: float, every: int, fine_every: int, margin: float) -> bool:
    """Evaluate at every `every`-th iteration, and at every `fine_every`-th once near the target: the last
    evaluation within `margin` of it, or the line through the last two reaching it before the next coarse
    one (from the second evaluation after the start on). Dense where the crossing is, cheap elsewhere."""
    if it % every == 0:
        return True
    if not curve or it % fine_every:
        return False
    (i1, l1) = curve[-1][:2]
    if l1 <= target + margin:
        return True
    if len(curve) < 2 or curve[-2][0] == 0:  # the untrained model's loss is far off the curve's line
        return False
    (i0, l0) = curve[-2][:2]
    slope = (l1 - l0) / (i1 - i0)  # loss per iteration, negative while it falls
    return slope < 0 and i1 + (target - l1) / slope < i1 + every


def run_chunk(r: Racer, n: int, target: float, every: int, fine_every: int, margin: float,
              clocks: tuple[Callable[[], float], Callable[[], float]]) -> None:
    """Up to n iterations of r, evaluating where due; r is done at the first evaluation at or below the
    target, or at its cap.

    Only iterations are timed, on both clocks (wall, and this process's CPU time): a stretch of iterations
    is closed with sync() before the clocks are read, and an evaluation's own time goes to eval_wall_s."""
    wall, cpu = clocks

    def close_stretch() -> None:
        r.sync()
        w, c = wall(), cpu()
        r.train_wall_s += w - start[0]
        r.train_cpu_s += c - start[1]
        start[:] = [w, c]

    start, trained = [wall(), cpu()], 0
    while True:
        fresh = not r.curve or r.curve[-1][0] != r.it  # not evaluated yet at this iteration
        if fresh and (eval_due(r.it, r.curve, target, every, fine_every, margin) or r.it == r.max_iters):
            close_stretch()
            loss = r.evaluate()
            w = wall()
            r.eval_wall_s += w - start[0]
            start[:] = [w, cpu()]
            r.curve.append([r.it, loss, r.train_wall_s, r.train_cpu_s])
            r.log({"iter": r.it, "val_loss": loss, "train_s": r.train_wall_s, "train_cpu_s": r.train_cpu_s})
            if loss <= target:
                r.reached = {"iter": r.it, "tokens": r.it * r.tokens_per_iter, "wall_s": r.train_wall_s,
                             "cpu_s": r.train_cpu_s, "val_loss": loss}
                return
        if r.it >= r.max_iters:
            r.stopped = True
            return
        if trained == n:
            break
        r.step(r.it)
        r.it += 1
        trained += 1
    close_stretch()


def race(racers: list[Racer], chunk: int, target: float, every: int, fine_every: int, margin: float,
         clocks=(time.perf_counter, time.process_time), progress: Callable[[Racer], None] = lambda r: None) -> None:
    """Alternate chunks of `chunk` iterations between the runs until each reaches target or its cap,
    so that whatever else loads the machine meanwhile hits all of them alike."""
    number = 0
    while not all(r.done for r in racers):
        for r in racers:
            if not r.done:
                first = r.it
                run_chunk(r, chunk, target, every, fine_every, margin, clocks)
                r.chunks.append((number, first, r.it))
                progress(r)
        number += 1


def plain_step(model, optimizer, batches: Callable[[], tuple], recipe: TrainConfig, rt: runtime.Runtime,
               set_lr: Callable[[int], None]) -> Callable[[int], torch.Tensor]:
    """nanoGPT's train.py iteration without its eval, checkpoints and logging: set the lr, micro-steps
    (forward under autocast, the next batch read while the device works, backward), clip, step, zero
    the grads. step(it) returns the last micro-step's loss, unsynchronised."""
    scaler, accum, xy = rt.grad_scaler(), recipe.gradient_accumulation_steps, []

    def step(it: int) -> torch.Tensor:
        set_lr(it)
        x, y = xy.pop() if xy else batches()
        for _ in range(accum):
            with rt.autocast():
                loss = model(x, y)[1] / accum
            x, y = batches()
            scaler.scale(loss).backward()
        xy.append((x, y))  # the next iteration's first batch, read already
        if recipe.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def build_racer(name: str, recipe: TrainConfig, seed: int, data_dir: str, vocab: int, cap: int, cfg: "BenchConfig",
                rt: runtime.Runtime, log_dir: Path | None) -> Racer:
    """nanogpt: GPT-2 with nanoGPT's AdamW (fused only on CUDA) and its cosine schedule; ours: the recipe's
    model and core.optim's optimizer and schedule. Both read batches as nanoGPT does, from their own
    generator seeded with `seed`, and start from torch.manual_seed(seed)."""
    from core.data import TokenData
    from core.evaluate import evaluate_split

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**(recipe.model_args() | {"vocab_size": vocab}))).to(rt.device).train()
    betas = (recipe.beta1, recipe.beta2)
    if name == "nanogpt":
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
                  for g in model.configure_optimizers(recipe.weight_decay, recipe.learning_rate, betas,
                                                      rt.device_type).param_groups]
        optimizer = torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=betas, fused=rt.device_type == "cuda")
        for g in optimizer.param_groups:
            g["base_lr"] = recipe.learning_rate
    else:
        optimizer = make_optimizer(model, recipe, rt.device_type)
    gen = torch.Generator().manual_seed(seed)
    train_path = Path(data_dir) / "train.bin"
    batches = lambda: nanogpt_batch(train_path, recipe.block_size, recipe.batch_size, rt.device, gen)  # noqa: E731
    step = plain_step(model, optimizer, batches, recipe, rt,
                      lambda it: optim.set_lr(optimizer, get_lr(it, recipe) / recipe.learning_rate))
    val = TokenData(data_dir, "val", recipe.block_size)

    def evaluate() -> float:
        return evaluate_split(model, val, batch_size=cfg.speedrun_eval_batch, device=rt.device,
                              autocast=rt.autocast).loss
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        write_json(log_dir / "config.json", to_dict(recipe) | {"seed": seed, "run": name})
        (log_dir / "log.jsonl").write_text("")

    def log(record: dict) -> None:
        if log_dir is not None:
            with open(log_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record | {"lr": get_lr(record["iter"], recipe)}) + "\n")
    return Racer(name, step, evaluate, cap, tokens_per_iter(recipe), rt.synchronize, log)


def speedrun_data(cfg: "BenchConfig", tmp: Path) -> tuple[str, str, int]:
    """(data_dir, what it is, vocab size): speedrun_data_dir if given, else the quick-start character data
    built from DEFAULT_CORPUS (or a generated text) into tmp."""
    from core.data import read_meta

    if cfg.speedrun_data_dir:
        meta = read_meta(cfg.speedrun_data_dir)
        return cfg.speedrun_data_dir, cfg.speedrun_data_dir, meta["vocab_size"]
    source, vocab = loop_dataset(tmp)
    return str(tmp), f"{source}, characters, 90/10 split", vocab


def speedrun_target(cfg: "BenchConfig", base: TrainConfig, data_dir: str, vocab: int, rt: runtime.Runtime) -> tuple[float, str]:
    """The target val loss and where it came from: --target, the recorded one, or measured now (nanoGPT's
    loop for speedrun_target_iters at the first seed, evaluated once at the end)."""
    if cfg.target is not None:
        return cfg.target, "--target"
    recorded = SPEEDRUN_TARGETS.get((cfg.speedrun_base, cfg.speedrun_shape, cfg.speedrun_target_iters))
    if recorded is not None and not cfg.speedrun_measure_target and not cfg.speedrun_data_dir:
        return recorded, f"recorded: nanoGPT's loop at {cfg.speedrun_target_iters} iterations, seed 1337"
    seed = int_list(cfg.speedrun_seeds, "speedrun_seeds")[0]
    r = build_racer("nanogpt", base, seed, data_dir, vocab, cfg.speedrun_target_iters, cfg, rt, None)
    race([r], cfg.speedrun_target_iters, -math.inf, cfg.speedrun_target_iters, cfg.speedrun_target_iters, 0.0)
    return r.curve[-1][1], f"measured now: nanoGPT's loop at {cfg.speedrun_target_iters} iterations, seed {seed}"


def bench_speedrun(cfg: "BenchConfig", rt: runtime.Runtime) -> dict:
    if rt.ddp:
        raise UserError("the speedrun section runs on one process; start bench.py without torchrun")
    shape = spec_list(cfg.speedrun_shape)
    runs = spec_list(cfg.speedrun_runs)
    base = read_recipe([cfg.speedrun_base, *shape], "--speedrun_base")
    recipes = {"nanogpt": base, "ours": read_recipe([cfg.speedrun_base, *spec_list(cfg.speedrun_ours), *shape],
                                                    "--speedrun_ours")}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, source, vocab = speedrun_data(cfg, Path(tmp))
        target, target_source = speedrun_target(cfg, base, data_dir, vocab, rt)
        print(f"speedrun target: val loss {target:.4f} ({target_source})", flush=True)
        seeds = []
        for seed in int_list(cfg.speedrun_seeds, "speedrun_seeds"):
            log_root = Path(cfg.speedrun_log_dir) / str(seed) if cfg.speedrun_log_dir else None
            racers = [build_racer(name, recipes[name], seed, data_dir, vocab,
                                  math.ceil(cfg.speedrun_max_iters_factor * recipes[name].max_iters), cfg, rt,
                                  log_root / name if log_root else None) for name in runs]
            race(racers, cfg.speedrun_chunk, target, cfg.speedrun_eval_every, cfg.speedrun_eval_fine,
                 cfg.speedrun_eval_margin, progress=lambda r: print(
                     f"seed {seed} {r.name}: iter {r.it}, val loss {r.curve[-1][1]:.4f}, {r.train_wall_s:.0f} s "
                     f"training", flush=True))
            seeds.append({"seed": seed, "runs": {r.name: {"reached": r.reached, "iters_run": r.it,
                                                          "train_wall_s": r.train_wall_s, "train_cpu_s": r.train_cpu_s,
                                                          "eval_wall_s": r.eval_wall_s, "curve": r.curve,
                                                          "alternated_chunks": len(r.chunks)} for r in racers}})
    return {"target": target, "target_source": target_source, "data": source, "runs": runs,
            "recipes": {name: f"{cfg.speedrun_base}" + "".join(f" + {s}" for s in spec_list(cfg.speedrun_ours))
                        if name == "ours" else cfg.speedrun_base for name in runs},
            "shape": cfg.speedrun_shape, "models": {name: model_text(GPTConfig(**(recipes[name].model_args() | {
                "vocab_size": vocab})), recipes[name].batch_size) for name in runs},
            "tokens_per_iter": {name: tokens_per_iter(recipes[name]) for name in runs},
            "eval": {"every": cfg.speedrun_eval_every, "fine_every": cfg.speedrun_eval_fine,
                     "margin": cfg.speedrun_eval_margin}, "chunk": cfg.speedrun_chunk, "seeds": seeds,
            "summary": speedrun_summary(seeds, runs)}


def speedrun_summary(seeds: list[dict], runs: list[str]) -> dict:
    """Per run: the mean over seeds of what it took to reach the target (None where a seed did not), and
    each run's ratio to the first run's on each clock."""
    out = {}
    for name in runs:
        got = [s["runs"][name]["reached"] for s in seeds]
        out[name] = None if None in got else {k: statistics.mean(g[k] for g in got)
                                              for k in ("iter", "tokens", "wall_s", "cpu_s")}
    first = out[runs[0]]
    for name in runs[1:]:
        if out[name] and first:
            out[name]["wall_ratio"] = out[name]["wall_s"] / first["wall_s"]
            out[name]["cpu_ratio"] = out[name]["cpu_s"] / first["cpu_s"]
            out[name]["iter_ratio"] = out[name]["iter"] / first["iter"]
    return out


# ---------------------------------------------------------------------------------------------
# report


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(rt: runtime.Runtime) -> dict:
    cpu = cpu_model()
    return {
        "cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": runtime.native_bf16(rt.device),
        "device": rt.device, "device_name": torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else cpu,
        "dtype": rt.dtype, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # Thread settings change CPU results a lot on a shared machine: OpenMP threads that spin
        # waiting for a descheduled peer make small ops many times slower.
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY",
                                            "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CPP_MARCH") if k in os.environ},
    }


def mib(n: float | str) -> str:
    if n == OOM:
        return OOM
    return f"{n / MiB:,.1f} MiB" if n >= MiB / 10 else f"{n / 1024:,.1f} KiB"


def num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def format_train(r: dict) -> str:
    peak = f"{r['peak_flops'] / 1e9:,.1f} GFLOP/s" if r["peak_flops"] else "n/a"
    with_memory = any("peak_memory_bytes" in row for row in r["rows"])  # CUDA only
    rows = []
    for row in r["rows"]:
        if "error" in row:
            rows.append([row["mode"], "-", row["error"], "-", "-"] + ["-"] * with_memory)
            continue
        mfu = f"{row['mfu'] * 100:.1f}%" if row["mfu"] is not None else "n/a"
        build = num(row["build_s"], 1) if "build_s" in row else "-"
        rows.append([row["mode"], build, num(row["step_s"] * 1e3, 1), num(row["tokens_per_s"]), mfu]
                    + ([mib(row["peak_memory_bytes"])] if with_memory else []))
    text = (f"### Training step (forward + backward + AdamW)\n{r['model']}; {r['params'] / 1e6:.2f}M parameters, "
            f"{r['tokens_per_step']:,} tokens per step\npeak for MFU: {peak} ({r['peak_flops_source']})\n\n"
            + table(["mode", "build s (1st step)", "step ms", "tokens/s", "MFU"] + ["peak memory"] * with_memory, rows))
    if "compiled_over_eager" in r:
        text += f"\n\ncompiled / eager tokens/s: {r['compiled_over_eager']:.2f}x"
    return text


def format_loop(r: dict) -> str:
    rows = [["plain loop (nanoGPT's)", num(r["plain_ms"], 2), "1.00x"],
            ["train.py", num(r["train_py_ms"], 2), f"{r['train_py_over_plain']:.2f}x"]]
    if "recipe_ms" in r:  # Muon's Newton-Schulz runs in bf16 only where bf16 is native (core/optim.py)
        rows.append([f"train.py + {r['recipe_config']} (Newton-Schulz in {r['muon_newton_schulz']})",
                     num(r["recipe_ms"], 2), f"{r['recipe_ms'] / r['plain_ms']:.2f}x"])
    text = (f"### Training iteration: train.py against a plain loop, and the modern recipe\n{r['config']}: {r['model']}, "
            f"accumulation {r['accum']}; median of {r['chunks']} chunks of {r['steps_per_chunk']} iterations each, "
            f"alternating\n\n" + table(["loop", "ms / iteration", "vs plain"], rows))
    if "recipe_ms" in r:
        text += (f"\n\n{r['recipe_config']} / classic train.py: {r['recipe_over_train_py']:.2f}x "
                 f"(median over chunks of each against the one before it)")
    return text


def format_muon(r: dict) -> str:
    rows = [[row["muon"] + (" (chosen here)" if row["chosen"] else ""), num(row["step_ms"], 2)] for row in r["rows"]]
    shapes = ", ".join("x".join(map(str, s)) for s in r["shapes"])
    return (f"### Muon's step alone\n{r['model']}: {r['matrices']} hidden matrices ({shapes}); bf16 native here: "
            f"{'yes' if r['native_bf16'] else 'no'}\n\n" + table(["Muon", "ms / step"], rows))


def format_attention(r: dict) -> str:
    rows = [[row["T"], mib(row["score_matrix_bytes"]), mib(row["naive_forward_bytes"]),
             mib(row["naive_forward_backward_bytes"]), mib(row["sdpa_forward_bytes"]),
             mib(row["sdpa_forward_backward_bytes"]),
             f"{row['naive_over_sdpa']:.1f}x" if row["naive_over_sdpa"] else "-"] for row in r["rows"]]
    text = (f"### Attention memory vs context length\none causal attention, {r['shape']}; peak memory above the "
            f"inputs, measured with {r['method']}; fused kernel: {r['sdpa_kernel']}\n\n"
            + table(["T", "scores B·nh·T² (theory)", "naive fwd", "naive fwd+bwd", "sdpa fwd", "sdpa fwd+bwd",
                     "naive/sdpa fwd+bwd"], rows))
    if "growth_exponent" in r:
        g = r["growth_exponent"]
        text += (f"\n\ngrowth as T^k from T={r['rows'][0]['T']} to {r['rows'][-1]['T']}: naive k = "
                 f"{g['naive_forward_bytes']:.2f} (fwd), {g['naive_forward_backward_bytes']:.2f} (fwd+bwd); sdpa k = "
                 f"{g['sdpa_forward_bytes']:.2f} (fwd), {g['sdpa_forward_backward_bytes']:.2f} (fwd+bwd)")
    return text


def format_decode(r: dict) -> str:
    rows = [[row["context"], OOM, OOM, OOM, OOM, "-"] if "error" in row else
            [row["context"], num(row["no_cache_ms"], 2), num(row["cache_ms"], 2), num(row["no_cache_tokens_per_s"], 1),
             num(row["cache_tokens_per_s"], 1), f"{row['speedup']:.1f}x"] for row in r["rows"]]
    g = r["generation"]
    if "error" in g:
        return (f"### Decoding, KV cache vs recomputing\n{r['model']}; {r['params'] / 1e6:.2f}M parameters\n\n"
                + table(["context", "no cache ms/token", "cache ms/token", "no cache tokens/s", "cache tokens/s",
                         "speedup"], rows) + f"\n\ngenerate(): {OOM}")
    gen_rows = [[name.replace("_", " "), p["tokens"], num(p["no_cache_s"], 2), num(p["cache_s"], 2),
                 num(p["no_cache_tokens_per_s"], 1), num(p["cache_tokens_per_s"], 1), f"{p['speedup']:.1f}x"]
                for name, p in g["parts"].items()]
    return (f"### Decoding, KV cache vs recomputing\n{r['model']}; {r['params'] / 1e6:.2f}M parameters\n\n"
            "per-token latency at each context length: the step that reads `context` tokens and predicts the next\n\n"
            + table(["context", "no cache ms/token", "cache ms/token", "no cache tokens/s", "cache tokens/s",
                     "speedup"], rows)
            + f"\n\ngenerate(): {g['prompt_tokens']}-token prompt, {g['new_tokens']} new tokens, greedy, "
              f"block_size {g['block_size']}, median of {g['repeats']} run(s); past the context the window moves "
              f"{g['window_shift']} token(s) at a time and the cache is refilled at each move:\n\n"
            + table(["part", "tokens", "no cache s", "cache s", "no cache tokens/s", "cache tokens/s", "speedup"],
                    gen_rows))


def format_prepare(r: dict) -> str:
    return (f"### Data preparation (GPT-2 BPE)\n{r['path']}, corpus: {r['corpus']}\n\n"
            + table(["chars", "tokens", "seconds", "tokens/s"],
                    [[num(r["chars"]), num(r["tokens"]), num(r["seconds"], 3), num(r["tokens_per_s"])]]))


def format_rolling(r: dict) -> str:
    rows = [[row["way"], num(row["ms_per_token"], 2), num(row["tokens_per_s"], 1)] for row in r["rows"]]
    return (f"### Decoding past the context, the window sliding one token per step\n{r['model']}; prompt = the "
            f"whole context, then {r['new_tokens']} tokens, median ms per token\n\n"
            + table(["way", "ms/token", "tokens/s"], rows))


def format_memory(r: dict) -> str:
    state = [[row["parallel"], row["processes"], mib(row["params"]), mib(row["grads"]), mib(row["optimizer"]),
              mib(row["params"] + row["grads"] + row["optimizer"])] for row in r["state"]]
    ac = [[row["activation_checkpointing"], mib(row["peak_bytes"]), num(row["step_s"] * 1e3, 1)]
          for row in r["checkpointing"]]
    off, on = r["checkpointing"]
    fits = [[row["model"], f"{row['params'] / 1e6:,.0f}M", row["parallel"], f"{row['gb']:.1f}",
             f"{row['gb_checkpointed']:.1f}", *row["fits"].values()] for row in r["fits"]]
    return (f"### Memory per process: ddp vs fsdp, activation checkpointing\n{r['model']}\n\n"
            "bytes held by each process after one AdamW step (the largest rank), gloo processes on the CPU\n\n"
            + table(["parallel", "processes", "params", "grads", "AdamW state", "total"], state)
            + "\n\nforward + backward, one process\n\n"
            + table(["activation checkpointing", "peak memory", "step ms"], ac)
            + f"\n\ncheckpointing: {on['peak_bytes'] / off['peak_bytes']:.2f}x the peak memory, "
              f"{on['step_s'] / off['step_s']:.2f}x the step time\n\n"
            "Computed, not measured (core.memory.gpu_training_memory): GB per GPU to train GPT-2 with AdamW, "
            f"micro-batch {FITS_MICRO_BATCH} x 1024 tokens, fsdp over {FITS_WORLD_SIZE} GPUs; fits if <= "
            f"{memory.FITS_FRACTION:.0%} of the GPU\n\n"
            + table(["model", "params", "parallel", "GB", "GB with AC", *(f"{gb} GB" for gb in GPU_GB)], fits))


def format_serve(r: dict) -> str:
    rows = []
    for row in r["rows"]:
        server_cpu = row.get("server_cpu_s")
        rows.append([row["clients"], num(row["requests_per_s"], 2), num(row["tokens_per_s"], 1),
                     num(row["in_process_tokens_per_s"], 1), f"{row['overhead']:.2f}x", num(row["in_process_cpu_s"], 2),
                     "n/a" if server_cpu is None else num(server_cpu, 2), num(row["server_client_cpu_s"], 2),
                     "n/a" if server_cpu is None else
                     f"{(server_cpu + row['server_client_cpu_s']) / row['in_process_cpu_s']:.2f}x"])
    return (f"### Serving: serve.py over HTTP against the same generations in-process\n{r['model']}; "
            f"{r['params'] / 1e6:.2f}M parameters; each client sends one /v1/completions request at once "
            f"({r['prompt_tokens']}-token prompt, {r['max_tokens']} new tokens, sampled); in-process: the same "
            f"generations one model.generate after another; wall: median of {r['repeats']}; CPU: seconds per run\n\n"
            + table(["clients", "requests/s", "tokens/s", "in-process tokens/s", "wall ratio", "in-process CPU s",
                     "server CPU s", "client CPU s", "CPU ratio"], rows))


def format_speedrun(r: dict) -> str:
    runs, first = r["runs"], r["runs"][0]
    rows = []
    for s in r["seeds"] + [{"seed": "mean", "runs": r["summary"]}]:
        for name in runs:
            got = s["runs"][name] if s["seed"] == "mean" else s["runs"][name]["reached"]
            if got is None:
                rows.append([s["seed"], name, "not reached", "-", "-", "-", "-", "-"])
                continue
            base = r["summary"][first] if s["seed"] == "mean" else s["runs"][first]["reached"]
            ratio = (lambda k: f"{got[k] / base[k]:.2f}x") if base else (lambda k: "-")
            rows.append([s["seed"], name, num(got["iter"]), num(got["tokens"]), num(got["wall_s"], 1),
                         num(got["cpu_s"], 1), ratio("wall_s"), ratio("cpu_s")])
    models = "\n".join(f"{name}: {r['recipes'][name]}; {r['models'][name]}, {r['tokens_per_iter'][name]:,} tokens "
                       f"per iteration" for name in runs)
    e = r["eval"]
    return (f"### Speedrun: training time to val loss {r['target']:.4f} on the whole val split\n"
            f"target: {r['target_source']}; data: {r['data']}\n{models}\n"
            f"evaluated every {e['every']} iterations, every {e['fine_every']} within {e['margin']} of the target; "
            f"the runs take turns of {r['chunk']} iterations; times count training only (evaluation apart)\n\n"
            + table(["seed", "run", "iters to target", "tokens", "train wall s", "train CPU s",
                     f"wall vs {first}", f"CPU vs {first}"], rows))


FORMATTERS = {"train": format_train, "loop": format_loop, "muon": format_muon, "attention": format_attention,
              "decode": format_decode, "prepare": format_prepare, "rolling": format_rolling, "memory": format_memory,
              "serve": format_serve, "speedrun": format_speedrun}


def main(argv: Sequence[str]) -> dict:
    start = time.perf_counter()
    cfg = load_config(argv)
    rt = runtime.setup(cfg.device, cfg.dtype)
    if "prepare" in section_list(cfg):
        GPT2Tokenizer()  # fail now, not after minutes of measuring, if the BPE file cannot be loaded
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads)
    try:
        result = run(cfg, rt)
    finally:
        torch.set_num_threads(threads)  # main() called in-process (tests) leaves the count as it was
    result["wall_s"] = time.perf_counter() - start
    result["machine"]["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    write_json(cfg.out, result)
    print(f"\n{result['wall_s']:.0f} s in all; wrote {cfg.out}")
    return result


def run(cfg: BenchConfig, rt: runtime.Runtime) -> dict:
    """Measure the chosen sections in order, printing each table as it is done."""
    result = {"machine": machine_info(rt), "config": to_dict(cfg)}
    m = result["machine"]
    print(f"## bench.py on {m['device_name']} ({m['cpu_cores']} cores, {m['torch_threads']} torch threads), "
          f"torch {m['torch']}, {rt.device} {rt.dtype}, {m['date']}")
    runners = {"train": lambda: bench_train(cfg, rt), "loop": lambda: bench_loop(cfg, rt),
               "muon": lambda: bench_muon(cfg, rt),
               "attention": lambda: bench_attention(cfg, rt), "decode": lambda: bench_decode(cfg, rt),
               "prepare": lambda: bench_prepare(cfg), "rolling": lambda: bench_rolling(cfg, rt),
               "memory": lambda: bench_memory(cfg, rt), "serve": lambda: bench_serve(cfg, rt),
               "speedrun": lambda: bench_speedrun(cfg, rt)}
    for name in SECTIONS:
        if name in section_list(cfg):
            t0 = time.perf_counter()
            result[name] = runners[name]()
            result[name]["section_s"] = time.perf_counter() - t0
            print(f"\n{FORMATTERS[name](result[name])}\n\n({result[name]['section_s']:.0f} s)", flush=True)
            write_json(cfg.out, result)  # what is measured is kept, whatever happens in the next section
    return result


if __name__ == "__main__":
    run_cli(main)
