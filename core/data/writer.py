"""Writing token files for core/data/loader.py, into a folder checked before any work: `{split}.bin` whole or not at
all, shards moved into place a split at a time, meta.json last (its token counts vouch for the token files). A token
id that does not fit the file's dtype is an error, never wrapped.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np

from core.data.loader import shard_paths
from core.data.tokenizer import HFTokenizer, Tokenizer
from core.errors import UserError
from core.fileio import atomic_path, fsync_dir, space_for, write_json


def script_out_dir(out_dir: str | None, script_file: str) -> Path:
    """--out_dir, or the running prepare.py's folder; one that cannot be made (a path through a file, no permission)
    is an error now, before any download or tokenizing."""
    path = Path(out_dir) if out_dir is not None else Path(script_file).resolve().parent
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"cannot write to the output folder '{path}': {existing} is a file; choose another --out_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to the output folder '{path}': {existing} is not writable; "
                        f"choose another --out_dir")
    return path


def checked_ids(ids, dtype, where: str) -> np.ndarray:
    """`ids` as an array of `dtype`; a UserError if any id would not fit (numpy would silently wrap it)."""
    arr = np.asarray(ids)
    info = np.iinfo(dtype)
    if arr.size == 0:
        return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise UserError(f"token ids for {where} must be integers, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        raise UserError(f"token id {hi if hi > info.max else lo} does not fit {np.dtype(dtype).name} ({info.min}.."
                        f"{info.max}) in {where}; use a wider dtype (uint32) or a smaller vocabulary")
    return arr.astype(dtype, copy=False)


# What a write of a dataset that ran out of space leaves (core/fileio.space_for's line ends with it).
NOTHING_REPLACED = "the dataset's earlier files are as they were: free space and run prepare.py again"


def write_tokens(path: str | os.PathLike, ids, dtype=np.uint16) -> int:
    arr = checked_ids(ids, dtype, str(path))
    with space_for(path, arr.nbytes, NOTHING_REPLACED), atomic_path(path) as tmp, open(tmp, "wb") as f:
        write_array(f, arr)
    return int(arr.size)


def write_array(f, arr: np.ndarray) -> None:
    """arr's bytes to the open file f through Python's write, so that a full disk is an OSError with ENOSPC
    (numpy's tofile reports only '43200 requested and 6144 written')."""
    f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


class ShardWriter:
    """Stream token ids into `{split}_000000.bin`, ... of `shard_tokens` ids each, staged in a hidden folder and moved
    into place (replacing older files) only when the `with` block ends without an exception: an interrupted prepare
    leaves the previous files, never a partial set that looks complete."""

    def __init__(self, out_dir: str | os.PathLike, split: str, shard_tokens: int, dtype=np.uint16):
        if shard_tokens < 1:
            raise UserError(f"shard_tokens must be at least 1, got {shard_tokens}")
        self.out_dir, self.split, self.shard_tokens, self.dtype = Path(out_dir), split, shard_tokens, dtype
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.staging = self.out_dir / f".{split}.staging-{os.getpid()}"
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        self.names: list[str] = []
        self.num_tokens, self._in_shard, self._file = 0, 0, None

    def write(self, ids) -> None:
        arr = checked_ids(ids, self.dtype, f"{self.out_dir / self.split}_*.bin")
        while arr.size:
            if self._file is None:
                self.names.append(f"{self.split}_{len(self.names):06d}.bin")
                self._file = open(self.staging / self.names[-1], "wb")
                self._in_shard = 0
            take = arr[: self.shard_tokens - self._in_shard]
            with space_for(self.staging / self.names[-1], None, NOTHING_REPLACED):
                write_array(self._file, take)
            self._in_shard += take.size
            self.num_tokens += take.size
            arr = arr[take.size:]
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if self._file is not None:
                self._file.close()
            shutil.rmtree(self.staging, ignore_errors=True)
            return
        if self._file is not None:
            self._close_shard()
        stale = shard_paths(self.out_dir, self.split) + [self.out_dir / f"{self.split}.bin"]
        final = [self.out_dir / name for name in self.names]
        for name, path in zip(self.names, final):
            os.replace(self.staging / name, path)
        for path in stale:
            if path not in final and path.exists():
                path.unlink()
        fsync_dir(self.out_dir)
        self.staging.rmdir()


def write_dataset(out_dir: str | os.PathLike, tokenizer_meta: dict, splits: dict[str, Iterable[int]],
                  dtype=np.uint16, **extra) -> dict:
    """Write `{split}.bin` for each split, then meta.json (last: its token counts vouch for the .bin files)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {**tokenizer_meta, "dtype": np.dtype(dtype).name, **extra}
    for split, ids in splits.items():
        meta[f"{split}_tokens"] = write_tokens(out_dir / f"{split}.bin", ids, dtype)
        for stale in shard_paths(out_dir, split):  # from an earlier sharded prepare into this folder
            stale.unlink()
    with space_for(out_dir / "meta.json", None, NOTHING_REPLACED):
        write_json(out_dir / "meta.json", meta)
    return meta


def token_dtype(tok: Tokenizer):
    return np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32


def write_meta(out_dir: Path, tok: Tokenizer, meta: dict) -> dict:
    """tokenizer.json (for other tools) beside meta.json for a BPE or a folder's tokenizer, then meta.json, last."""
    if isinstance(tok, HFTokenizer):
        with space_for(out_dir / "tokenizer.json", len(tok.json.encode()), NOTHING_REPLACED), \
                atomic_path(out_dir / "tokenizer.json") as tmp:
            tmp.write_text(tok.json, encoding="utf-8")
    return write_dataset(out_dir, tok.meta(), {}, token_dtype(tok), **meta)
