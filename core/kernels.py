"""Which of torch's kernels a forward runs, chosen per call and per device: model.Kernels' two hooks, set on a model
from outside with choose_kernels (core/training/parallel.py, core/decoding/decode.py's inference_model), as sharding
and compile are. The network computes the same function whatever is chosen.

    CPU     one_row_kernels (decoding at one bf16 row: oneDNN off) and short_training_attention (bf16 training
            over few keys: the math backend); core/cpu.py
    CUDA    inference_attention: attention outside a training forward runs without cuDNN's kernels

Each choice leaves every other call to torch's own, so one model carries them wherever it runs. Measured side by side
with what each replaces: docs/performance.md ("Decoding against the bandwidth bound", "Mixed precision on a CPU with
native bfloat16", "On a GPU").
"""
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from core import cpu
from model import GPT, Kernels

# Every SDPA backend but cuDNN's: torch tries them in its own order and falls back as it does.
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class DeviceKernels(Kernels):
    def blocks(self, x: torch.Tensor) -> contextlib.AbstractContextManager:
        return cpu.one_row_kernels(x)

    def attention(self, q: torch.Tensor, Tk: int, training: bool) -> contextlib.AbstractContextManager:
        if q.device.type == "cuda":
            return inference_attention(q, training)
        return cpu.short_training_attention(q, Tk, training)


def choose_kernels(model: GPT) -> GPT:
    model.use_kernels(DeviceKernels())
    return model


def inference_attention(q: torch.Tensor, training: bool) -> contextlib.AbstractContextManager:
    """Attention on a CUDA device that autograd does not record (decoding, prefill, evaluation): every SDPA backend
    but cuDNN's. torch prefers cuDNN's attention on Hopper, which builds an execution plan for each new shape;
    decoding meets a new key length at every token, and on an H200 generate() ran at a tenth of its speed until
    every length had its plan. A training forward keeps torch's choice: its shapes repeat, and cuDNN is faster there."""
    if training and torch.is_grad_enabled() and q.requires_grad:
        return contextlib.nullcontext()
    return sdpa_kernel(WITHOUT_CUDNN)
