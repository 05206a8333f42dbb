"""Checkpoints: written atomically, loaded with weights_only=True, metadata as JSON.

A checkpoint is one torch file holding only tensors and plain containers:
    {"format": FORMAT, "meta": "<JSON text>", "model": state_dict,
     "optimizer": state_dict | None, "scaler": state_dict | None, "rng": {...} | None}
"meta" carries the model arguments, the run config, the tokenizer metadata, the
iteration and the best val loss. The model saved is always the plain (uncompiled,
unwrapped) module, so no '_orig_mod.' or 'module.' prefixes ever appear.

Two files live in out_dir: ckpt.pt (the newest) and ckpt.prev.pt (the one before).
A save first makes ckpt.prev.pt a copy of the current ckpt.pt, then replaces
ckpt.pt atomically, so at every instant both names hold complete checkpoints.
Loading checks every record's CRC-32 (torch.load does not), so a truncated or
bit-flipped file is an error, never silently wrong weights.
"""
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from core.errors import UserError, first_line
from core.fileio import atomic_path, remove_orphaned_temps
from model import GPT, GPTConfig

FORMAT = "nanogpt-checkpoint/1"
CKPT_NAME = "ckpt.pt"
PREV_NAME = "ckpt.prev.pt"


def _keep_previous(path: Path) -> None:
    """Make PREV_NAME a complete copy of the current checkpoint (hard link when possible)."""
    if not path.exists():
        return
    prev = path.with_name(PREV_NAME)
    with atomic_path(prev) as tmp:
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)


def save_checkpoint(out_dir: str | os.PathLike, meta: dict[str, Any], model: dict, optimizer: dict | None = None,
                    scaler: dict | None = None, rng: dict | None = None) -> Path:
    """Write out_dir/ckpt.pt atomically, keeping the previous one as ckpt.prev.pt.

    Raises OSError (e.g. disk full) with both earlier files intact.
    """
    path = Path(out_dir) / CKPT_NAME
    state = {"format": FORMAT, "meta": json.dumps(meta), "model": model,
             "optimizer": optimizer, "scaler": scaler, "rng": rng}
    remove_orphaned_temps(out_dir)  # left by a run killed mid-save
    _keep_previous(path)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint onto the CPU; `state["meta"]` comes back as a dict.

    Raises UserError for a missing file, a truncated or corrupt one, or a file that
    is not a checkpoint of this project.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ... --out_dir={path.parent})")
    _verify_archive(path)
    try:
        # mmap: tensors are read from the file as they are used, not all copied into host RAM at once
        # (every rank loads the checkpoint on resume).
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(e)})") from None
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else "objects other than tensors and plain containers"
        raise UserError(f"{path} holds pickled Python objects ({what}), which are never loaded: unpickling them "
                        f"could run any code. It is not a checkpoint written by this project's train.py") from None
    except Exception as e:  # anything else torch.load rejects
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(e)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a checkpoint written by this project's train.py")
    try:
        state["meta"] = json.loads(state["meta"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise UserError(f"checkpoint {path} has unreadable metadata") from None
    return state


def _verify_archive(path: Path) -> None:
    """Check that `path` is a complete zip archive (what torch.save writes) whose records match their
    CRC-32s. torch.load skips this check: a flipped bit in a tensor would load as a wrong weight.
    It reads the file once more, at disk or page-cache speed (~1 s for GPT-2's 1.5 GB checkpoint)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0 and info.file_size:
                    continue  # written with torch.serialization.set_crc32_options(False): nothing to check
                with archive.open(info) as record:
                    while record.read(1 << 24):  # zipfile raises BadZipFile at the end on a CRC mismatch
                        pass
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(e)}); it cannot be "
                        f"loaded") from None


def load_latest(out_dir: str | os.PathLike, log=print) -> tuple[dict[str, Any], Path]:
    """Load ckpt.pt from out_dir; if it is damaged, say so and fall back to ckpt.prev.pt."""
    out_dir = Path(out_dir)
    path, prev = out_dir / CKPT_NAME, out_dir / PREV_NAME
    if not path.exists() and not prev.exists():
        raise UserError(f"no checkpoint in {out_dir} (expected {CKPT_NAME}); train first or check --out_dir")
    try:
        return load_checkpoint(path), path
    except UserError as e:
        if not prev.exists():
            raise
        try:
            state = load_checkpoint(prev)
        except UserError as e_prev:
            raise UserError(f"no intact checkpoint in {out_dir}: {e}; and {e_prev}") from None
        log(f"warning: {e}; using the older complete checkpoint {prev} (iter {state['meta'].get('iter_num')})")
        return state, prev


def model_from_checkpoint(state: dict[str, Any], **overrides) -> GPT:
    """Rebuild the saved GPT (on the CPU) from a loaded checkpoint; overrides such as
    dropout or attn_backend change how it runs, not its weights."""
    model = GPT(GPTConfig(**(state["meta"]["model_args"] | overrides)))
    model.load_state_dict(state["model"])
    return model
