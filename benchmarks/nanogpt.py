"""nanoGPT's training loop, the loop section's and the speedrun's yardstick: its batches, optimizer and step as its
train.py makes them, on the CPU quick start's data (char_dataset).
"""
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from benchmarks import common
from core import runtime
from core.data.tokenizer import CharTokenizer
from core.data.writer import write_dataset
from core.training import optim
from core.training.train_config import TrainConfig, get_lr
from model import GPT


def char_dataset(out_dir: Path) -> tuple[str, int]:
    """DEFAULT_CORPUS (or a generated text) as characters, split 90/10, into out_dir: (its source, vocab size)."""
    if Path(common.DEFAULT_CORPUS).is_file():
        text, source = Path(common.DEFAULT_CORPUS).read_text(encoding="utf-8"), common.DEFAULT_CORPUS
    else:
        text, source = common.generated_text(common.GENERATED_CHARS), "generated text"
    tok = CharTokenizer.from_text(text)
    n = int(0.9 * len(text))
    meta = write_dataset(out_dir, tok.meta(), {"train": tok.encode(text[:n]), "val": tok.encode(text[n:])})
    return source, meta["vocab_size"]


def get_batch(path: Path, block_size: int, batch_size: int, device: str, generator: torch.Generator | None = None,
              seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: a fresh memmap, random starts from `generator` (None: torch's global one). seq_len (ours'
    warm-up; None: block_size) keeps the first seq_len tokens of windows drawn as for block_size."""
    T = block_size if seq_len is None else seq_len
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])          # (B, T)
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])  # (B, T)
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def adamw(model: GPT, recipe: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """nanoGPT's optimizer: AdamW over the groups of nanoGPT's configure_optimizers (core.training.optim's AdamW),
    fused only on CUDA (the per-tensor loop elsewhere); each group's base_lr is the peak rate, for optim.set_lr."""
    betas = (recipe.beta1, recipe.beta2)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "base_lr": recipe.learning_rate}
              for g in optim.build_optimizer(model, "adamw", recipe.learning_rate, recipe.weight_decay, betas,
                                             device_type).param_groups]
    return torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=betas, fused=device_type == "cuda")


def train_step(model, optimizer, batches: Callable[[int], tuple], recipe: TrainConfig,
               rt: runtime.Runtime) -> Callable[[int], torch.Tensor]:
    """nanoGPT's train.py iteration without its eval, checkpoints and logging, the next batch read while the device
    works. batches(it): a micro-batch of iteration it; step(it) returns the last micro-step's loss, unsynchronised."""
    scaler, accum, xy = rt.grad_scaler(), recipe.gradient_accumulation_steps, []

    def step(it: int) -> torch.Tensor:
        optim.set_lr(optimizer, get_lr(it, recipe) / recipe.learning_rate)
        x, y = xy.pop() if xy else batches(it)
        for micro in range(accum):
            with rt.autocast():
                loss = model(x, y)[1] / accum
            x, y = batches(it if micro + 1 < accum else it + 1)
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
