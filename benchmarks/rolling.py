"""Decoding past the context with window_shift=1 (nanoGPT's rule: the window slides one token per step).

Per token, on the decode section's model, greedy: learned positions and RoPE (the cache refilled at every step), and
RoPE with the rolling KV cache (sliding-window attention); the yardstick is RoPE's cached step inside the context.
"""
import dataclasses
import statistics
import time

import torch

from benchmarks import decode, markdown
from benchmarks.common import at_least, median_time, model_text, num
from core import runtime
from core.decoding.decode import generate_stream
from model import GPT


@dataclasses.dataclass
class Settings:
    roll_new_tokens: int = 48  # tokens decoded past the context, each way


def check(cfg) -> None:
    at_least(cfg, 1, "roll_new_tokens")


def measure(cfg, rt: runtime.Runtime) -> dict:
    ways = {"learned, cache refilled": ("learned", False), "rope, cache refilled": ("rope", False),
            "rope, rolling cache": ("rope", True)}
    base = decode.model_config(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(base.vocab_size, (cfg.decode_batch_size, base.block_size), generator=gen).to(rt.device)
    rows = []
    for name, (pos, rolling) in ways.items():
        torch.manual_seed(cfg.seed)
        model = GPT(dataclasses.replace(base, pos_embedding=pos)).to(rt.device).eval()

        def decode_tokens(n: int) -> list[float]:
            times, t0 = [], time.perf_counter()
            with rt.autocast():
                for _ in generate_stream(model, prompt, n, temperature=0.0, window_shift=1, rolling_cache=rolling):
                    rt.synchronize()
                    times.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
            return times[1:]  # the first token pays for the prefill
        decode_tokens(3)  # warm-up
        per_token = statistics.median(decode_tokens(cfg.roll_new_tokens + 1))
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


def table(r: dict) -> str:
    rows = [[row["way"], num(row["ms_per_token"], 2), num(row["tokens_per_s"], 1)] for row in r["rows"]]
    return (f"### Decoding past the context, the window sliding one token per step\n{r['model']}; prompt = the "
            f"whole context, then {r['new_tokens']} tokens, median ms per token\n\n"
            + markdown.table(["way", "ms/token", "tokens/s"], rows))
