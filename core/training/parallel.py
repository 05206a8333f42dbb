"""Data parallelism, activation checkpointing, compile and the CPU's kernel choices, applied to the model from
outside: the optimizer is built after parallelize (fsdp replaces the parameters by shards).

ddp: full copies per process, gradients all-reduced; fsdp: fully_shard (FSDP2) on each Block, then the root, as
torchtitan does (docs/sharding.md). One process: neither wrapper, the same code path; GPT's names stay as they are.
"""
import contextlib
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from core import kernels, runtime
from core.errors import UserError

PARALLELS = ("ddp", "fsdp")


def check_parallel(parallel: str, dtype: str) -> None:
    if parallel not in PARALLELS:
        raise UserError(f"parallel must be 'ddp' or 'fsdp', got '{parallel}'")
    if parallel == "fsdp" and dtype == "float16":
        # torch.amp.GradScaler cannot unscale sharded (DTensor) gradients
        raise UserError("parallel=fsdp runs in float32 or bfloat16, not float16; use --dtype=bfloat16 "
                        "(or --parallel=ddp for float16)")


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Keep only each Block's input in the forward pass and recompute its insides in the backward pass. The
    wrapper's state_dict hooks drop its prefix, so checkpoints keep GPT's names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block)


def parallelize(model: torch.nn.Module, rt: runtime.Runtime, parallel: str, activation_checkpointing: bool,
                compile: bool) -> torch.nn.Module:
    """The module to call for training. `model` itself stays the one to save and to build the optimizer
    from: with fsdp it is sharded in place (its parameters become DTensor shards)."""
    check_parallel(parallel, rt.dtype)  # the resolved dtype: --dtype=auto is float16 on GPUs without bf16
    kernels.choose_kernels(model)  # the CPU's and CUDA's kernel choices per call (core/kernels.py)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if parallel == "fsdp" and rt.distributed:
        if compile:
            # Per-Block compile (torchtitan's order: checkpointing, compile, then sharding): FSDP's
            # all-gathers run between the compiled Blocks rather than as graph breaks inside one graph.
            for block in model.transformer.h:
                block.compile()
        shard(model, rt)
        return model
    if compile:
        model = torch.compile(model)
    if rt.distributed:
        model = DDP(model, device_ids=[rt.local_rank] if rt.device_type == "cuda" else None)
    return model


def shard(model: torch.nn.Module, rt: runtime.Runtime) -> None:
    """fully_shard each Block, then the root (embeddings, final norm, and the head tied to wte)."""
    # Imported here: torch.distributed.fsdp brings in DTensor, 0.7 s of every start that never shards.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if rt.device_type == "cuda" and rt.dtype == "bfloat16":
        # bf16 copies for compute (what autocast would cast to anyway); the float32 shards stay the
        # optimizer's master weights, and gradients are reduced in float32.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


@contextlib.contextmanager
def micro_step(model: torch.nn.Module, rt: runtime.Runtime, parallel: str, last: bool):
    """Gradients are reduced across processes once per step, on the last micro-step; fsdp also keeps the gathered
    parameters and float32 gradients between micro-steps: memory for N-1 fewer all-gathers and reduce-scatters."""
    if not rt.distributed or last and parallel == "ddp":
        yield
    elif parallel == "ddp":
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        yield


# A model is sharded, or a tensor a DTensor, only after shard() imported their modules: until then the answer is no,
# and asking imports nothing.
def is_sharded(model: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t

