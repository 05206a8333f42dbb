"""Atomic file writes: a reader sees the old file or the complete new one, never a part. And a full disk
(ENOSPC, EDQUOT) as one line, wherever it strikes: a checkpoint, log.jsonl, a dataset, an exported folder.

    with space_for(path, needed=nbytes, then="the previous checkpoint ckpt.pt (iter 40) is intact"):
        ...  # a write that may fill the disk: a UserError naming path, the space needed and free, and `then`
"""
import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from core.errors import UserError, is_disk_full


def format_bytes(n: float) -> str:
    """'512 B', '651.2 KiB', '1.4 GiB': a size as a person reads it, in powers of 1024 as `df -h` and `free -h`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full_error(path: str | os.PathLike, needed: int | None, then: str) -> UserError:
    """The one line for a write to path that ran out of space, with the free space where it (or its nearest existing
    parent) lies, when that can be read."""
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(next((p for p in (Path(path), *Path(path).parents) if p.exists()), ".")).free
    size = " and ".join(([f"it needs about {format_bytes(needed)}"] if needed else [])
                        + ([f"{format_bytes(free)} is free"] if free is not None else []))
    return UserError(f"no space left to write {path} (No space left on device, or over quota){': ' if size else ''}"
                     f"{size}; {then}")


@contextlib.contextmanager
def space_for(path: str | os.PathLike, needed: int | None = None, then: str = "") -> Iterator[None]:
    """A full disk inside (an OSError, or a library's own error for one) becomes disk_full_error; `then` says
    what is intact and what to do. Any other error passes as it is."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise disk_full_error(path, needed, then) from None


def fsync_dir(path: Path) -> None:
    # The rename itself must reach the disk, or a crash can undo it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it over `path`. On any exception (disk
    full, a kill signal turned into an exception, a bug) the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """atomic_path for a folder: yield a temporary directory beside `path` (which is absent or an empty folder);
    once the block ends, rename it to `path`. On any exception the temporary directory is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.is_dir():
            path.rmdir()  # empty: a folder with files in it is an error here, never replaced
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_orphaned_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files atomic_path left in `directory` when its process died mid-write
    (SIGKILL, preemption, OOM): a checkpoint-sized `.{name}.tmp-{pid}` for every such kill would
    otherwise pile up until the disk is full. A file whose process still runs is left alone."""
    removed = []
    for tmp in Path(directory).glob(".*.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid() or _process_exists(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        removed.append(tmp)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
