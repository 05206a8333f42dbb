"""Ours (`inference_model(..., quantize=...)`) beside torchao's int8 configs (weight-only, and with dynamically
quantized activations as ours' int8): greedy decoding at batch 1 of a GPT-2-small-shaped model (random weights),
tokens/s (docs/performance.md, "peers").

    pip install torchao==0.18.0 && python scripts/compare_torchao.py --threads=1

torchao is not a dependency of this project; this script measures whether it should be. Its compiled row
includes torch.compile's recompilations as the context grows, as `generate` meets them.
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repo importable

from core import runtime  # noqa: E402
from core.decoding.decode import generate, inference_model  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def rate(model, tokens: int) -> float:
    idx = torch.zeros(1, 14, dtype=torch.long)  # a 14-token prompt, as the peers section's
    with torch.no_grad():
        generate(model, idx, 8, temperature=0)  # warm-up
        t0 = time.perf_counter()
        generate(model, idx, tokens, temperature=0)
        return tokens / (time.perf_counter() - t0)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=60)
    args = parser.parse_args(argv)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        sys.exit("error: needs torchao (pip install torchao==0.18.0); it is not one of this project's dependencies")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)).eval()
    rt = runtime.Runtime("cpu", "cpu", "float32")
    rows = [(f"ours, {q}", rate(inference_model(copy.deepcopy(base), rt, quantize=q), args.tokens))
            for q in ("none", "int8", "int4")]
    for config in (Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()):
        model = copy.deepcopy(base)
        quantize_(model, config)
        name = type(config).__name__
        rows.append((f"torchao {name}, eager", rate(model, args.tokens)))
        rows.append((f"torchao {name}, torch.compile", rate(torch.compile(model), args.tokens)))
    print(f"| decoding, {args.threads} thread(s) | tokens/s |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
