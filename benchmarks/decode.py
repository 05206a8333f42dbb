"""Decoding: per-token latency with and without the KV cache, then whole generate() runs.

The model (decode_*) is cast once to --dtype, as sample.py decodes (inference_model); decode_batch_size rows at once;
weights are random (speed does not depend on them) and decoding is greedy. Per-token latency at each context length:
no cache = one forward over the whole context (what generate(use_cache=False) does per token); cache = one token
through a KV cache already holding the context. Then a whole generate() run each way, timed token by token, past the
context moving the window as sample.py does (block_size // 2 at a time; see --gen_window_shift).

Then the cached step against the memory-bandwidth bound (benchmarks/bandwidth.py; --bound_models) and, last, the
fixed-shape step against the eager one (benchmarks/fixed_step.py; the fixed_* flags, --fixed_precisions= skips it).
"""
import dataclasses
import statistics
import time

import torch

from benchmarks import bandwidth, fixed_step
from benchmarks.common import (OOM, gpt_config, int_list, markdown_table, median_time, model_text, num,
                               or_oom, some_of)
from core import runtime
from core.config import at_least
from core.decoding.decode import generate_stream, inference_model, window_shift
from core.errors import UserError
from model import GPT


@dataclasses.dataclass
class Settings:
    # the baby GPT's shape (6 layers, 384 wide, 6 heads, 256-token context)
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
    bound_models: str = "quickstart,gpt2"  # the step against the bandwidth bound: some of bandwidth.SHAPES; "" none
    bound_steps: int = 20      # cached steps timed per row of the bound table (their median)
    fixed_precisions: str = "auto"  # the fixed step's rows: auto is float32,int8 on a CPU, float32,bfloat16 on CUDA
    fixed_batches: str = "1"
    fixed_rounds: int = 3      # rounds alternating eager, fixed and compiled
    fixed_steps: int = 10      # steps timed per way per round


PRESETS = {"gpt2": dict(decode_n_layer=12, decode_n_head=12, decode_n_embd=768, decode_block_size=1024,
                        decode_vocab_size=50304, decode_contexts="128,256,512,1024", gen_repeats=3)}


def check(cfg) -> None:
    at_least(cfg, 1, "gen_repeats", "gen_prompt_len", "gen_new_tokens", "bound_steps", "fixed_rounds", "fixed_steps")
    int_list(cfg.fixed_batches, "fixed_batches")
    fixed_step.precisions(cfg, "cpu")
    some_of(cfg.bound_models, bandwidth.SHAPES, "bound_models")
    contexts = int_list(cfg.decode_contexts, "decode_contexts")
    if max(contexts) > cfg.decode_block_size:
        raise UserError(f"decode_contexts go up to {max(contexts)}, past decode_block_size {cfg.decode_block_size}")
    if cfg.gen_window_shift is not None and not 1 <= cfg.gen_window_shift <= cfg.decode_block_size:
        raise UserError(f"gen_window_shift must be in [1, decode_block_size={cfg.decode_block_size}] or None, "
                        f"got {cfg.gen_window_shift}")
    if cfg.gen_prompt_len > cfg.decode_block_size:
        raise UserError(f"gen_prompt_len {cfg.gen_prompt_len} is longer than decode_block_size {cfg.decode_block_size}")
    gpt_config(cfg, "decode_", bias=cfg.bias)


def token_times(model: GPT, prompt: torch.Tensor, new_tokens: int, use_cache: bool, shift: int,
                rt: runtime.Runtime, steps=None) -> list[float]:
    """Seconds until each new token of a greedy generate_stream run was ready, token by token."""
    times = []
    t0 = time.perf_counter()
    for _ in generate_stream(model, prompt, new_tokens, temperature=0.0, use_cache=use_cache, window_shift=shift,
                             steps=steps):
        rt.synchronize()
        t = time.perf_counter()
        times.append(t - t0)
        t0 = t
    return times


def measure(cfg, rt: runtime.Runtime) -> dict:
    torch.manual_seed(cfg.seed)
    mc = gpt_config(cfg, "decode_", bias=cfg.bias)
    model, steps = inference_model(GPT(mc), rt)  # as sample.py: weights cast once, float32 next-token logits
    B = cfg.decode_batch_size
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(mc.vocab_size, (B, mc.block_size), generator=gen).to(rt.device)  # (B, block_size)
    with torch.no_grad():
        rows = [or_oom(lambda: decode_row(cfg, model, tokens, C, rt), rt, {"context": C, "error": OOM})
                for C in int_list(cfg.decode_contexts, "decode_contexts")]
    generation = or_oom(lambda: generation_times(cfg, model, tokens[:, :cfg.gen_prompt_len], rt, steps), rt,
                        {"error": OOM})
    shapes = some_of(cfg.bound_models, bandwidth.SHAPES, "bound_models")
    bound = {"rows": []}  # none: no table, and no copy timed for one
    if shapes:
        bound = or_oom(lambda: bandwidth.measure(shapes, rt, cfg.bound_steps, cfg.seed), rt, {"error": OOM})
    return {"model": model_text(mc, B), "params": model.get_num_params(), "rows": rows, "generation": generation,
            "bound": bound, "fixed": fixed_step.measure(cfg, mc, rt)}


def decode_row(cfg, model: GPT, tokens: torch.Tensor, C: int, rt: runtime.Runtime) -> dict:
    """Latency of the step that reads C tokens and predicts the next, without and with the KV cache."""
    B = tokens.size(0)
    no_cache_s = median_time(lambda: model(tokens[:, :C], last_only=True), cfg.warmup, cfg.repeats, rt.synchronize)
    cache_s = median_time(bandwidth.cached_step(model, C, B), cfg.warmup, cfg.repeats, rt.synchronize)
    return {"context": C, "no_cache_ms": no_cache_s * 1e3, "cache_ms": cache_s * 1e3,
            "no_cache_tokens_per_s": B / no_cache_s, "cache_tokens_per_s": B / cache_s,
            "speedup": no_cache_s / cache_s}


def generation_times(cfg, model: GPT, prompt: torch.Tensor, rt: runtime.Runtime, steps=None) -> dict:
    """generate() end to end, as sample.py calls it, cache against no cache, split where the window first moves.

    Once prompt + generated tokens pass block_size the window of tokens the model sees moves on, by window_shift tokens
    at a time. With learned positions every cached key is then stale, so the cache is refilled at each move: with
    window_shift=1 every step past the context is a full forward, cache or not; with block_size // 2 (sample.py's
    default) one refill serves block_size // 2 tokens.
    """
    P, N, block = prompt.size(1), cfg.gen_new_tokens, model.config.block_size
    shift = window_shift(cfg.gen_window_shift, block)
    inside = min(N, block - P + 1)  # tokens sampled while the whole sequence still fits the window
    for use_cache in (False, True):  # warm-up: a few tokens each way
        token_times(model, prompt, min(N, 4), use_cache, shift, rt, steps)
    runs = {mode: [token_times(model, prompt, N, use_cache, shift, rt, steps) for _ in range(cfg.gen_repeats)]
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


def table(r: dict) -> str:
    columns = ["context", "no cache ms/token", "cache ms/token", "no cache tokens/s", "cache tokens/s", "speedup"]
    rows = [[row["context"], OOM, OOM, OOM, OOM, "-"] if "error" in row else
            [row["context"], num(row["no_cache_ms"], 2), num(row["cache_ms"], 2), num(row["no_cache_tokens_per_s"], 1),
             num(row["cache_tokens_per_s"], 1), f"{row['speedup']:.1f}x"] for row in r["rows"]]
    bound, g = r["bound"], r["generation"]
    bound = (f"\n\nstep against the bandwidth bound: {OOM}" if "error" in bound else
             "\n\n" + bandwidth.table(bound) if bound["rows"] else "")
    generation = f"\n\ngenerate(): {OOM}" if "error" in g else (
        f"\n\ngenerate(): {g['prompt_tokens']}-token prompt, {g['new_tokens']} new tokens, greedy, "
        f"block_size {g['block_size']}, median of {g['repeats']} run(s); past the context the window moves "
        f"{g['window_shift']} token(s) at a time and the cache is refilled at each move:\n\n"
        + markdown_table(["part", "tokens", "no cache s", "cache s", "no cache tokens/s", "cache tokens/s", "speedup"],
                         [[name.replace("_", " "), p["tokens"], num(p["no_cache_s"], 2), num(p["cache_s"], 2),
                           num(p["no_cache_tokens_per_s"], 1), num(p["cache_tokens_per_s"], 1), f"{p['speedup']:.1f}x"]
                          for name, p in g["parts"].items()]))
    return (f"### Decoding, KV cache vs recomputing\n{r['model']}; {r['params'] / 1e6:.2f}M parameters\n\n"
            "per-token latency at each context length: the step that reads `context` tokens and predicts the next\n\n"
            + markdown_table(columns, rows) + generation + bound
            + ("\n\n" + fixed_step.table(r["fixed"]) if r["fixed"]["rows"] else ""))
