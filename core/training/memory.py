"""Training memory: an estimate from the config alone, what a device has free, which errors are out-of-memory. The
parameter count is exact (built on the meta device); activations follow Korthikanti et al. 2022 (section 4.1),
which is rough: it refuses runs that plainly do not fit, never tunes one.
"""
import contextlib
import dataclasses
import os

import torch

from core.errors import UserError
from core.fileio import format_bytes
from core.training.optim import OPTIMIZERS
from model import GPT


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def _params_on_meta(config) -> list[tuple[str, torch.Tensor]]:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        return list(GPT(config).named_parameters())  # a tied matrix appears once


def parameter_count(config) -> int:
    return sum(p.numel() for _, p in _params_on_meta(config))


def estimate_training_memory(config, batch_size: int, optimizer: str = "adamw",
                             param_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None,
                             seq_len: int | None = None, shards: int = 1, micro_steps: int = 1,
                             activation_checkpointing: bool = False) -> MemoryEstimate:
    """Bytes to train a GPT of `config` on batch_size sequences of seq_len (None: block_size): weights and gradients
    in param_dtype, optimizer state in fp32, one micro-batch's activations in compute_dtype. shards > 1 (fsdp): 1/shards
    of each, plus the Blocks gathered at a time: two (running, prefetched), or every one with micro_steps > 1 (they
    stay gathered between micro-steps). activation_checkpointing: each layer keeps only its input, and one layer its
    whole set while it is recomputed."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    params = _params_on_meta(config)
    n = sum(p.numel() for _, p in params)
    weight = torch.empty((), dtype=param_dtype).element_size()
    # fp32 state per parameter: AdamW's two moments; Muon's momentum alone for the hidden matrices.
    state = 4 * sum(p.numel() * (1 if optimizer == "muon" and name.startswith("transformer.h.") and p.dim() == 2
                                 else 2) for name, p in params)
    act = torch.empty((), dtype=compute_dtype or param_dtype).element_size()
    B, T, C = batch_size, seq_len or config.block_size, config.n_embd
    # Korthikanti et al.: a layer keeps 34 * B*T*C bytes at 2 bytes an element, i.e. 17 elements per
    # (token, channel); attention that forms the (T, T) scores (the naive backend) keeps 5 * nh * T
    # more bytes per token. Fused sdpa kernels do not keep the scores.
    per_layer = 17 * B * T * C * act
    if getattr(config, "attn_backend", "sdpa") == "naive":
        per_layer += 5 * B * config.n_head * T * T * act // 2
    layers = (config.n_layer * B * T * C * act + per_layer) if activation_checkpointing else config.n_layer * per_layer
    # The logits and the gradient of the cross-entropy with respect to them, in fp32.
    logits = 2 * B * T * config.vocab_size * 4
    gathered = 0
    if shards > 1:
        block = sum(p.numel() for name, p in params if name.startswith("transformer.h.0."))
        gathered = n if micro_steps > 1 else min(2, config.n_layer) * block
    return MemoryEstimate(params=n * weight // shards + gathered * act, grads=n * weight // shards + gathered * weight,
                          optimizer=state // shards, activations=layers + logits)


def available_bytes(device: str) -> int | None:
    """Free memory a new allocation on `device` can use; None where it cannot be told (mps)."""
    kind = device.split(":")[0]
    if kind == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]  # (free, total)
    if kind == "cpu":
        with contextlib.suppress(OSError), open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        try:  # not Linux: free pages (an underestimate: the page cache could be reclaimed)
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_fits(est: MemoryEstimate, device: str, processes_sharing: int = 1, what: str = "") -> None:
    """Refuse with one line when the estimate plainly exceeds what the device has free; processes_sharing: processes
    on this machine drawing from the same memory (CPU ranks share RAM)."""
    free = available_bytes(device)
    needed = est.total * processes_sharing
    if free is None or needed <= free:
        return
    share = f" x {processes_sharing} processes" if processes_sharing > 1 else ""
    raise UserError(
        f"training needs about {format_bytes(needed)}{share} on {device} (weights {format_bytes(est.params)}, "
        f"gradients {format_bytes(est.grads)}, optimizer {format_bytes(est.optimizer)}, activations "
        f"{format_bytes(est.activations)}{what}) but only {format_bytes(free)} is available; use a smaller "
        f"batch_size (with more gradient_accumulation_steps), block_size or model")


def is_out_of_memory(e: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's OutOfMemoryError, and the RuntimeErrors of the CPU and
    MPS allocators, which have no class of their own."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and any(
        s in str(e) for s in ("DefaultCPUAllocator", "can't allocate memory", "out of memory"))
