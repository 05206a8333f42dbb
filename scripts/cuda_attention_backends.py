"""generate() on a CUDA device with torch's own SDPA backends and with every one but cuDNN's, side by side, and a
training step each way (docs/performance.md, "On a GPU"): why core/kernels.py keeps cuDNN's attention out of
decoding on CUDA and in training.

    python scripts/cuda_attention_backends.py        # GPT-2 small's shape, random weights; about a minute on an H200

For bfloat16 and float32, batch 1 and 8: 150 greedy tokens twice each way (the first pass meets every key length
for the first time, the second finds cuDNN's plans built), ms per step and whether the tokens are the same; then a
forward and backward of 8 x 1024 tokens each way. The model carries no kernel choices, so torch picks every
kernel; the "without cuDNN" rows are what kernels.inference_attention gives a decoding model.
"""
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repo importable

from core import kernels, runtime  # noqa: E402
from core.decoding.decode import generate, keep_float32_head  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

GPT2 = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
WAYS = {"torch's choice": contextlib.nullcontext, "without cuDNN": lambda: sdpa_kernel(kernels.WITHOUT_CUDNN)}


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    print("| dtype | batch | backends | first pass ms/step | second pass ms/step | same tokens |\n"
          "|---|---:|---|---:|---:|---|")
    for dtype in ("bfloat16", "float32"):
        rt = runtime.Runtime("cuda:0", "cuda", dtype)
        model = GPT(GPT2).to(rt.device, rt.ptdtype).eval()  # as inference_model decodes it, its kernels aside
        if dtype != "float32":
            keep_float32_head(model)
        for batch in (1, 8):
            idx = torch.zeros(batch, 1, dtype=torch.long, device=rt.device)
            out = {}
            for way, ctx in WAYS.items():
                passes = []
                for _ in range(2):
                    with ctx():
                        passes.append(timed(lambda: out.__setitem__(way, generate(model, idx, 150, temperature=0))))
                same = torch.equal(*out.values()) if len(out) == 2 else "-"
                print(f"| {dtype} | {batch} | {way} | {passes[0] * 1000 / 150:.2f} | {passes[1] * 1000 / 150:.2f} | "
                      f"{same} |", flush=True)
    print("\n| training step, bf16 autocast, 8 x 1024, forward + backward | ms |\n|---|---:|")
    rt = runtime.Runtime("cuda:0", "cuda", "bfloat16")
    model = GPT(GPT2).to(rt.device)
    x = torch.randint(0, GPT2.vocab_size, (8, 1024), device=rt.device)

    def step():
        with rt.autocast():
            loss = model(x, x)[1]
        loss.backward()

    for way, ctx in WAYS.items():
        with ctx():
            ms = [timed(step) * 1000 for _ in range(4)][-1]  # after three warm-ups
        print(f"| {way} | {ms:.1f} |")


if __name__ == "__main__":
    main()
