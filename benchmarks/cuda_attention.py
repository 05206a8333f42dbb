"""generate() on a CUDA device with torch's own SDPA backends and with every one but cuDNN's, side by side, and a
training step each way (docs/performance.md, "On a GPU"): why core/kernels.py keeps cuDNN's attention out of
decoding on CUDA and in training. On another device the section is skipped.

    python bench.py --sections=cuda_attention --device=cuda   # GPT-2 small's shape, random weights; about a minute on an H200

For bfloat16 and float32, batch 1 and 8: 150 greedy tokens twice each way (the first pass meets every key length
for the first time, the second finds cuDNN's plans built), ms per step and whether the tokens are the same; then a
forward and backward of 8 x 1024 tokens each way. The model carries no kernel choices, so torch picks every
kernel; the "without cuDNN" rows are what kernels.inference_attention gives a decoding model.
"""
import contextlib
import dataclasses

import torch
from torch.nn.attention import sdpa_kernel

from benchmarks.common import median_time
from core import kernels, runtime
from core.decoding.decode import generate, keep_float32_head
from model import GPT, GPTConfig

GPT2 = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
WAYS = {"torch's choice": contextlib.nullcontext, "without cuDNN": lambda: sdpa_kernel(kernels.WITHOUT_CUDNN)}
IN_DEFAULT_RUN = False  # only when --sections names it


def unavailable(rt: runtime.Runtime) -> str | None:
    return None if rt.device_type == "cuda" else "needs a CUDA device (--device=cuda)"


def measure(cfg, rt: runtime.Runtime) -> dict:
    torch.manual_seed(0)
    decoding = []
    for dtype in ("bfloat16", "float32"):
        drt = dataclasses.replace(rt, dtype=dtype)
        model = GPT(GPT2).to(drt.device, drt.ptdtype).eval()  # as inference_model decodes it, its kernels aside
        if dtype != "float32":
            keep_float32_head(model)
        for batch in (1, 8):
            idx = torch.zeros(batch, 1, dtype=torch.long, device=drt.device)
            out = {}
            for way, ctx in WAYS.items():
                def run():
                    out[way] = generate(model, idx, 150, temperature=0)
                with ctx():
                    first, second = (median_time(run, 0, 1, rt.synchronize) * 1000 / 150 for _ in range(2))
                same = torch.equal(*out.values()) if len(out) == 2 else "-"
                decoding.append({"dtype": dtype, "batch": batch, "way": way, "first_ms": first, "second_ms": second,
                                 "same": same})
    trt = dataclasses.replace(rt, dtype="bfloat16")
    model = GPT(GPT2).to(trt.device)
    x = torch.randint(0, GPT2.vocab_size, (8, GPT2.block_size), device=trt.device)

    def step():
        with trt.autocast():
            loss = model(x, x)[1]
        loss.backward()

    training = {}
    for way, ctx in WAYS.items():
        with ctx():
            training[way] = median_time(step, 3, 1, rt.synchronize) * 1000  # after three warm-ups
    return {"decoding": decoding, "training": training}


def table(r: dict) -> str:
    lines = ["| dtype | batch | backends | first pass ms/step | second pass ms/step | same tokens |",
             "|---|---:|---|---:|---:|---|"]
    lines += [f"| {x['dtype']} | {x['batch']} | {x['way']} | {x['first_ms']:.2f} | {x['second_ms']:.2f} | {x['same']} |"
              for x in r["decoding"]]
    lines += ["", "| training step, bf16 autocast, 8 x 1024, forward + backward | ms |", "|---|---:|"]
    lines += [f"| {way} | {ms:.1f} |" for way, ms in r["training"].items()]
    return "\n".join(lines)
