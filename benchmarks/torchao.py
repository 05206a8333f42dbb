"""Ours (`inference_model(..., quantize=...)`) beside torchao's int8 configs (weight-only, and with dynamically
quantized activations as ours' int8): greedy decoding at batch 1 of a GPT-2-small-shaped model (random weights)
on the CPU, tokens/s (docs/performance.md, "peers").

    pip install torchao==0.18.0 && python bench.py --sections=torchao --threads=1

torchao is not a dependency of this project; this section measures whether it should be, and without it says so
in one line. Its compiled row includes torch.compile's recompilations as the context grows, as `generate` meets them.
"""
import copy
import dataclasses
import importlib.util
import time

import torch

from core import runtime
from core.decoding.decode import generate, inference_model
from model import GPT, GPTConfig


@dataclasses.dataclass
class Settings:
    torchao_tokens: int = 60  # greedy tokens timed per row, after a 14-token prompt (the peers section's)


IN_DEFAULT_RUN = False  # only when --sections names it


def unavailable(rt: runtime.Runtime) -> str | None:
    if rt.device_type != "cpu":
        return "measured on the CPU: run it with --device=cpu"
    if importlib.util.find_spec("torchao") is None:
        return "needs torchao (pip install torchao==0.18.0); it is not one of this project's dependencies"
    return None


def rate(model, tokens: int) -> float:
    idx = torch.zeros(1, 14, dtype=torch.long)  # a 14-token prompt, as the peers section's
    with torch.no_grad():
        generate(model, idx, 8, temperature=0)  # warm-up
        t0 = time.perf_counter()
        generate(model, idx, tokens, temperature=0)
        return tokens / (time.perf_counter() - t0)


def measure(cfg, rt: runtime.Runtime) -> dict:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)).eval()
    f32 = dataclasses.replace(rt, dtype="float32")
    rows = [(f"ours, {q}", rate(inference_model(copy.deepcopy(base), f32, quantize=q)[0], cfg.torchao_tokens))
            for q in ("none", "int8", "int4")]
    for config in (Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()):
        model = copy.deepcopy(base)
        quantize_(model, config)
        name = type(config).__name__
        rows.append((f"torchao {name}, eager", rate(model, cfg.torchao_tokens)))
        rows.append((f"torchao {name}, torch.compile", rate(torch.compile(model), cfg.torchao_tokens)))
    return {"threads": torch.get_num_threads(), "rows": rows}


def table(r: dict) -> str:
    lines = [f"| decoding, {r['threads']} thread(s) | tokens/s |", "|---|---:|"]
    return "\n".join(lines + [f"| {name} | {value:.1f} |" for name, value in r["rows"]])
