"""Where a prepare script's text comes from and where its files go: a corpus's one text file (--input,
else input.txt in the output folder, else downloaded there) and the output folder, checked before any
download or tokenizing. The data/<name>/prepare.py scripts call these, as do core/data/corpus.py and
core/data/web.py.
"""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from core.errors import UserError
from core.fileio import atomic_path


SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def text_source(input_path: str | None, out_dir: str | os.PathLike, url: str, timeout: float = 10.0) -> Path:
    """The file to read: `input_path`; else `out_dir`/input.txt; else `url` downloaded and saved there."""
    if input_path is not None:
        return Path(input_path)
    local = Path(out_dir) / "input.txt"
    if local.is_file():
        return local
    print(f"downloading {url} to {local}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data = r.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"could not download {url} ({reason}); "
                        f"pass a local copy with --input=path/to/input.txt") from None
    local.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(local) as tmp:
        tmp.write_bytes(data)
    return local


def script_out_dir(out_dir: str | None, script_file: str) -> Path:
    """--out_dir, or by default the folder of the prepare.py that is running. Checked now, without
    creating anything: a folder that cannot be made (a path through a file, no permission) is an
    error before any download or tokenizing, not after."""
    path = Path(out_dir) if out_dir is not None else Path(script_file).resolve().parent
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"cannot write to the output folder '{path}': {existing} is a file; choose another --out_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to the output folder '{path}': {existing} is not writable; "
                        f"choose another --out_dir")
    return path
