"""Perplexity and bits per byte on a whole split: every token scored exactly once, in a fixed order, so the figure is
deterministic and comparable across runs (training's estimate_loss samples random batches instead, for speed).
Windows of block_size start every `stride` tokens, Hugging Face's sliding window (docs/evaluation.md).
"""
import contextlib
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F

from core.data.loader import TokenData
from core.errors import UserError


def evaluating(fn):
    """fn(model, ...) without gradients and with model in eval mode (no dropout), handed back in the mode it came in."""
    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        was_training = model.training
        try:
            with torch.no_grad():
                return fn(model.eval(), *args, **kwargs)
        finally:
            model.train(was_training)
    return run


def token_losses(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each target, x (B, T) -> (B, T) float32; 0 where y is -1."""
    return target_losses(model(x, y)[0], y)  # with targets the model returns logits at every position


def target_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """token_losses from logits (B, T, vocab): -log p(y), whose negative rl.py's policy gradient weighs."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none").view_as(y)


def split_windows(n_tokens: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows (begin, end, new) that score tokens 1..n_tokens-1 of a stream once each: one feeds tokens[begin:end],
    predicts tokens[begin+1:end+1] and scores its last `new` targets, which no earlier window scored."""
    if not 1 <= stride <= block_size:
        raise UserError(f"stride {stride} is larger than block_size {block_size}; windows would skip tokens"
                        if stride > 1 else f"stride must be in [1, block_size={block_size}], got {stride}")
    windows, scored = [], 0  # targets tokens[1:scored+1] are done
    for begin in range(0, max(n_tokens - 1, 0), stride):
        end = min(begin + block_size, n_tokens - 1)
        windows.append((begin, end, end - scored))
        scored = end
        if end == n_tokens - 1:
            break
    return windows


@dataclass
class SplitResult:
    loss: float        # mean cross-entropy per token, in nats
    perplexity: float  # exp(loss)
    tokens: int        # tokens scored
    bpb: float | None = None  # bits per UTF-8 byte of the scored text (given token_bytes), None otherwise
    bytes: int = 0            # the UTF-8 bytes of the scored targets


@evaluating
def evaluate_split(model, data: TokenData, stride: int | None = None, batch_size: int = 8, device="cpu",
                   autocast=None, rank: int = 0, world_size: int = 1, progress=None,
                   token_bytes: list[int] | None = None, stopped=None) -> SplitResult | None:
    """Score every token of `data` (one split; each .bin file is its own stream) once; stride None: block_size. Each
    rank scores every world_size-th batch of windows, the sums all-reduced. progress(done, total) after each batch;
    stopped() before each batch on every rank alike (it may be a collective): True ends it with None. token_bytes
    (each id's UTF-8 bytes) adds bits per byte, special tokens left out of both sums as in nanochat's evaluate_bpb."""
    T = data.block_size
    stride = stride or T
    if data.starts is not None:  # chat: each conversation is its own stream (context never crosses into it)
        ends = [*data.starts[1:].tolist(), data.num_tokens]
        jobs = [(data.paths[0], (s + b, s + e, new)) for s, end in zip(data.starts.tolist(), ends)
                for b, e, new in split_windows(end - s, T, stride)]
    else:
        jobs = [(path, w) for path, n in zip(data.paths, data.sizes) for w in split_windows(n, T, stride)]
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # (summed loss, tokens, loss on bytes, bytes)
    # Each id's bytes (none given: no bytes, no bpb), then a 0 read by y = -1 (not scored) and ids past the tokenizer
    nbytes = torch.tensor([*(token_bytes or []), 0], dtype=torch.float64, device=device)
    # Every rank runs as many forwards (a sharded model's are collectives): a rank past the end
    # scores the first batch again and does not count it.
    for step in range(math.ceil(len(jobs) / (world_size * batch_size))):
        if stopped is not None and stopped():
            return None
        i = (step * world_size + rank) * batch_size
        x, y = _window_batch(data, jobs[i:i + batch_size] if i < len(jobs) else jobs[:batch_size], T)
        x, y = x.to(device), y.to(device)
        with autocast() if autocast else contextlib.nullcontext():
            losses = token_losses(model, x, y)  # (B, T)
        if i < len(jobs):
            b = nbytes[y.clamp(max=len(nbytes) - 1)]  # (B, T) the bytes of each target
            sums += torch.stack([losses.double().sum(), (y >= 0).sum().double(), (losses.double() * (b > 0)).sum(),
                                 b.sum()])
        if progress:
            progress(min(i + batch_size, len(jobs)), len(jobs))
    if world_size > 1:
        dist.all_reduce(sums)
    loss = sums[0].item() / sums[1].item()
    bpb = sums[2].item() / math.log(2) / sums[3].item() if sums[3].item() else None
    return SplitResult(loss, math.exp(loss), int(sums[1].item()), bpb, int(sums[3].item()))


def _window_batch(data: TokenData, jobs, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, T) and targets (B, T), -1 where a target is not scored or past a short window.
    Padding at the end of a row is harmless: causal attention never lets it reach earlier positions."""
    x = np.zeros((len(jobs), T), dtype=np.int64)
    y = np.full((len(jobs), T), -1, dtype=np.int64)
    for row, (path, (begin, end, new)) in enumerate(jobs):
        chunk = np.asarray(np.memmap(path, dtype=data.dtype, mode="r")[begin:end + 1], dtype=np.int64)
        n = end - begin
        x[row, :n] = chunk[:-1]
        y[row, n - new:n] = chunk[1:][n - new:]
        if data.mask_path is not None:  # chat: only the assistant's tokens are scored
            learned = np.fromfile(data.mask_path, dtype=np.uint8, count=n, offset=begin + 1).astype(bool)
            y[row, :n][~learned] = -1
    return torch.from_numpy(x), torch.from_numpy(y)
