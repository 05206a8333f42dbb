"""Checkpoints saved and resumed, a training run's side (the format: core/weights/checkpoint.py). A kill at any
instant leaves a complete checkpoint under the current name or the previous one: it costs at most the newest save.
"""
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core.errors import UserError, first_line, is_disk_full
from core.fileio import atomic_path, disk_full_error, fsync_dir, remove_orphaned_temps, write_json
from core.runtime import Runtime
from core.training import optim, parallel
from core.weights.checkpoint import (CKPT_NAME, FORMAT, META_NAME, PREV_NAME, PREV_SHARDED_NAME, RNG_NAME,
                                     SHARDED_FORMAT, SHARDED_NAME, crc32, find_checkpoint, load_checkpoint,
                                     one_process_quietly, read_shards, read_sharded_meta)


def save(out_dir: str | os.PathLike, meta: dict[str, Any], model: torch.nn.Module, optimizer, scaler, rt: Runtime,
         sharded: bool) -> Path | None:
    """Every rank calls it, with the plain module (never the compiled or DDP-wrapped one). Returns the path
    written (None on ranks other than 0). Non-finite weights are refused, so the last good checkpoint stays."""
    if not all_finite(model, rt):
        raise UserError(f"the model has non-finite weights at iter {meta['iter_num']}; not saving over the last "
                        f"good checkpoint in {out_dir}")
    rng = gather_rng(rt)  # collective: every rank takes part
    # The space a save takes, said only when the disk is full: every rank's shards, or the whole state.
    needed = lambda: state_bytes([model.state_dict(), optimizer.state_dict()]) * (rt.world_size if sharded else 1)  # noqa: E731
    if sharded:
        return _saving(Path(out_dir) / SHARDED_NAME, needed, save_sharded, out_dir, meta, model, optimizer, rng)
    return rt.on_master(lambda: _saving(Path(out_dir) / CKPT_NAME, needed, save_checkpoint, out_dir, meta,
                                        model.state_dict(), optimizer.state_dict(), scaler.state_dict(), rng))


def _saving(path: Path, needed, write, *args) -> Path:
    """write(*args), a failure one line naming path and the last intact checkpoint (a full disk: the space)."""
    try:
        return write(*args)
    except Exception as e:
        if is_disk_full(e):
            raise disk_full_error(path, needed(), last_intact(path.parent)) from None
        if not isinstance(e, OSError):
            raise
        raise UserError(f"could not save a checkpoint in {path.parent}: {e.strerror or e}; "
                        f"{last_intact(path.parent)}") from None


def last_intact(out_dir: Path) -> str:
    """What a failed write leaves to go on from, for its one line: the newest intact checkpoint and its iteration."""
    path = find_checkpoint(out_dir, prev=True)
    if path is None:
        return "no checkpoint was saved yet"
    try:
        meta = read_sharded_meta(path) if path.is_dir() else load_checkpoint(path)["meta"]
    except UserError:
        return f"{path} is not intact: see its error at the next resume"
    return (f"the last intact checkpoint, {path} (iter {meta.get('iter_num')}), is untouched: free space, then "
            f"continue with --init_from=resume (or auto)")


def state_bytes(obj) -> int:
    """The bytes of the tensors in nested dicts and lists (a DTensor: this process's shard)."""
    if isinstance(obj, torch.Tensor):
        return parallel.local(obj).nbytes
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def all_finite(module: torch.nn.Module, rt: Runtime) -> bool:
    """Whether every weight is finite, on every rank (fsdp: each holds a shard, so all must agree)."""
    finite = all(bool(torch.isfinite(parallel.local(p)).all()) for p in module.parameters())
    if not parallel.is_sharded(module):
        return finite
    flag = torch.tensor(float(finite), device=rt.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def gather_rng(rt: Runtime) -> dict:
    """Every rank's RNG states (dropout draws from them), on each rank: {"cpu": [rank 0's, ...], "cuda": [...]}."""
    states = {"cpu": torch.get_rng_state()}
    if rt.device_type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(rt.device)
    every = [states]
    if rt.distributed:
        every = [None] * rt.world_size
        dist.all_gather_object(every, states, group=rt.flag_group)  # host-side: the states are CPU tensors
    return {k: [s[k] for s in every] for k in states}


def restore(resumed, model: torch.nn.Module, optimizer, scaler, rt: Runtime, log) -> tuple[int, float]:
    """Load the optimizer, loss scaler and RNG states (and, for fsdp, the sharded weights) of the checkpoint
    being resumed (resumed: core/weights/resolver.py's Weights); returns its (iter_num, best_val_loss)."""
    state, meta = resumed.state, resumed.state["meta"]
    if state["model"] is None:  # fsdp: every rank reads its own shards
        with optim.restoring(optimizer, meta["config"].get("optimizer", "adamw")):
            state["rng"] = load_sharded(resumed.path, model, optimizer)
    elif state["optimizer"] is None:  # a nanoGPT checkpoint whose AdamW state has other shapes than ours
        log(f"note: {resumed.path} holds no optimizer state this model's parameters fit; the optimizer starts fresh")
    else:
        optim.load_state(optimizer, state["optimizer"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    saved = len(rng["cpu"]) if rng else 0
    if saved != rt.world_size:
        log(f"note: the checkpoint was saved by {saved or 'an unknown number of'} process(es), this run has "
            f"{rt.world_size}: each iteration reads the same global batch (from seed and iteration), but dropout "
            f"draws are re-seeded, so losses will not repeat the first run's bit for bit")
    else:
        torch.set_rng_state(rng["cpu"][rt.rank])
        if rt.device_type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"][rt.rank], rt.device)
    return meta["iter_num"], meta["best_val_loss"]


# -----------------------------------------------------------------------------
# ckpt.pt


def save_checkpoint(out_dir: str | os.PathLike, meta: dict[str, Any], model: dict, optimizer: dict | None = None,
                    scaler: dict | None = None, rng: dict | None = None) -> Path:
    """Write out_dir/ckpt.pt atomically, the current one first becoming ckpt.prev.pt (a hard link where it can).
    Raises OSError (e.g. disk full) with both earlier files intact."""
    path = Path(out_dir) / CKPT_NAME
    state = {"format": FORMAT, "meta": json.dumps(meta), "model": model,
             "optimizer": optimizer, "scaler": scaler, "rng": rng}
    remove_orphaned_temps(out_dir)  # left by a run killed mid-save
    if path.exists():
        with atomic_path(path.with_name(PREV_NAME)) as tmp:
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copyfile(path, tmp)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)  # through a Python file: a full disk is then an OSError (ENOSPC), not C++'s own error
    return path


# -----------------------------------------------------------------------------
# sharded checkpoints (parallel="fsdp"): torch.distributed.checkpoint

SHARDED_TEMP = ".ckpt.dcp.tmp"  # one name for every process; a run killed mid-save leaves it, the next save clears it


def _agree(ok: bool, error: str) -> None:
    """Rank 0's outcome, on every rank: all raise together, none waits for a peer that gave up."""
    if dist.is_initialized():
        flag = [ok]
        dist.broadcast_object_list(flag, src=0)
        ok = flag[0]
    if not ok:
        raise OSError(error)


def save_sharded(out_dir: str | os.PathLike, meta: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, rng: dict | None = None) -> Path:
    """Write out_dir/ckpt.dcp, the current one becoming ckpt.prev.dcp; every process writes its own shards into
    SHARDED_TEMP, then rank 0 adds rng.pt and meta.json, last, and renames it into place. Raises OSError with both
    earlier checkpoints intact."""
    import torch.distributed.checkpoint as dcp  # only fsdp runs pay its import (with DTensor's)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out_dir, rank0 = Path(out_dir), not dist.is_initialized() or dist.get_rank() == 0
    tmp = out_dir / SHARDED_TEMP
    ok = True
    if rank0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError:
            ok = False
    _agree(ok, f"could not create {tmp}")
    model_state, optim_state = get_state_dict(model, optim.torch_optimizers(optimizer))
    try:  # DCP gathers a failure on any rank (e.g. a full disk) into one CheckpointException on every rank
        with one_process_quietly():
            dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=dcp.FileSystemWriter(tmp),
                     no_dist=not dist.is_initialized())
    except dcp.api.CheckpointException as e:  # every rank is past its writes: rank 0 may remove them
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        failures = list(getattr(e, "failures", {}).values())
        raise OSError(f"writing the shards failed ({first_line(failures[0] if failures else e)})") from None
    ok, error = True, ""
    if rank0:
        try:
            if rng is not None:
                torch.save(rng, tmp / RNG_NAME)
            files = {p.name: crc32(p) for p in sorted(tmp.iterdir())}
            write_json(tmp / META_NAME, {"format": SHARDED_FORMAT, "meta": meta, "files": files})
            fsync_dir(tmp)
            path, prev = out_dir / SHARDED_NAME, out_dir / PREV_SHARDED_NAME
            if path.exists():  # killed between the two renames: ckpt.prev.dcp is complete (resume falls back to it)
                shutil.rmtree(prev, ignore_errors=True)
                os.replace(path, prev)
            os.replace(tmp, path)
            fsync_dir(out_dir)
        except OSError as e:
            ok, error = False, f"{e.strerror or e}"
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(ok, error)
    return out_dir / SHARDED_NAME


def load_sharded(path: Path, model: torch.nn.Module, optimizer) -> dict | None:
    """Load a sharded checkpoint into `model` and `optimizer`, sharded or not, at any number of processes;
    every process calls it. Returns the saved RNG states (rng.pt), or None."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optimizers = optim.torch_optimizers(optimizer)
    model_state, optim_state = get_state_dict(model, optimizers)
    state = {"model": model_state, "optimizer": optim_state}
    read_shards(path, state)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rng = path / RNG_NAME
    return torch.load(rng, map_location="cpu", weights_only=True) if rng.exists() else None
