"""Atomic file writes: a reader sees the old file or the complete new one, never a part."""
import contextlib
import json
import os
from pathlib import Path
from typing import Iterator


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
    """Yield a temporary path beside `path`; on success fsync it and rename it over `path`.

    On any exception (disk full, a kill signal turned into an exception, a bug) the
    temporary file is removed and `path` is left exactly as it was.
    """
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
