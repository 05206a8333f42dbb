"""Preparing token data: text sources, tokenizing, and writing token files and shards with their
meta.json, in the format core/data.py reads. The data/<name>/prepare.py scripts call it.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from core.data import shard_paths
from core.errors import UserError, first_line
from core.fileio import atomic_path, fsync_dir, write_json
from core.tokenizer import GPT2Tokenizer, Tokenizer


SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


# ---------------------------------------------------------------------------------------------
# writing token files


def _checked_ids(ids, dtype, where: str) -> np.ndarray:
    """`ids` as an array of `dtype`; a UserError if any id would not fit (numpy would silently wrap it)."""
    arr = np.asarray(ids)
    info = np.iinfo(dtype)
    if arr.size == 0:
        return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise UserError(f"token ids for {where} must be integers, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        bad = hi if hi > info.max else lo
        raise UserError(f"token id {bad} does not fit {np.dtype(dtype).name} ({info.min}..{info.max}) in {where}; "
                        f"use a wider dtype (uint32) or a smaller vocabulary")
    return arr.astype(dtype, copy=False)


def write_tokens(path: str | os.PathLike, ids, dtype=np.uint16) -> int:
    """Write token ids to `path` atomically (whole file or nothing); return how many were written."""
    arr = _checked_ids(ids, dtype, str(path))
    with atomic_path(path) as tmp:
        arr.tofile(tmp)
    return int(arr.size)


class ShardWriter:
    """Stream token ids into `{split}_000000.bin`, `{split}_000001.bin`, ... of `shard_tokens` ids each.

    Shards are written into a hidden staging folder and moved into place only when the whole split
    is done (leaving the `with` block without an exception, or commit()), replacing any older
    `{split}.bin` / shards. An interrupted prepare leaves the previous files as they were, and never
    a partial set that looks complete.
    """

    def __init__(self, out_dir: str | os.PathLike, split: str, shard_tokens: int, dtype=np.uint16):
        if shard_tokens < 1:
            raise UserError(f"shard_tokens must be at least 1, got {shard_tokens}")
        self.out_dir, self.split, self.shard_tokens, self.dtype = Path(out_dir), split, shard_tokens, dtype
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.staging = self.out_dir / f".{split}.staging-{os.getpid()}"
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        self.names: list[str] = []
        self.num_tokens = 0
        self._file = None
        self._in_shard = 0

    def write(self, ids) -> None:
        arr = _checked_ids(ids, self.dtype, f"{self.out_dir / self.split}_*.bin")
        while arr.size:
            if self._file is None:
                self.names.append(f"{self.split}_{len(self.names):06d}.bin")
                self._file = open(self.staging / self.names[-1], "wb")
                self._in_shard = 0
            take = arr[: self.shard_tokens - self._in_shard]
            self._file.write(take.tobytes())
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

    def commit(self) -> list[Path]:
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
        return final

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


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
    write_json(out_dir / "meta.json", meta)
    return meta


# ---------------------------------------------------------------------------------------------
# preparing: shared by data/<name>/prepare.py


def read_text_source(input_path: str | None, out_dir: str | os.PathLike, url: str, timeout: float = 10.0) -> str:
    """The text of `input_path`; else of `out_dir`/input.txt; else download `url` and save it there."""
    if input_path is not None:
        path = Path(input_path)
        if not path.is_file():
            raise UserError(f"--input file '{input_path}' not found")
        return _read_utf8(path)
    local = Path(out_dir) / "input.txt"
    if local.is_file():
        return _read_utf8(local)
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
    return data.decode("utf-8")


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); pass a text file") from None


def split_text(text: str, train_fraction: float = 0.9) -> tuple[str, str]:
    n = int(len(text) * train_fraction)
    return text[:n], text[n:]


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


@dataclasses.dataclass
class TextPrepareConfig:
    input: str | None = None    # a local text file; default: input.txt in out_dir, else downloaded there
    out_dir: str | None = None  # default: the prepare.py script's own folder


@dataclasses.dataclass
class WebPrepareConfig:
    data_files: str | None = None    # local parquet/json/jsonl/txt files with a `text` column (comma-separated,
                                     # globs allowed; each .txt file is one document); default: the hub dataset
    out_dir: str | None = None       # default: the prepare.py script's own folder
    val_fraction: float = 0.0005     # of documents, held out as the val split
    seed: int = 2357                 # of the train/val split
    num_proc: int = max(1, (os.cpu_count() or 2) // 2)  # worker processes for download and tokenization
    shard_tokens: int = 100_000_000  # tokens per .bin shard: 200 MB of uint16
    cache_dir: str | None = None     # Hugging Face datasets cache; default ~/.cache/huggingface/datasets

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"val_fraction must be between 0 and 1, got {self.val_fraction}")
        if self.num_proc < 1:
            raise UserError(f"num_proc must be at least 1, got {self.num_proc}")
        if self.shard_tokens < 1:
            raise UserError(f"shard_tokens must be at least 1, got {self.shard_tokens}")


def prepare_text_corpus(cfg: TextPrepareConfig, make_tokenizer: Callable[[str], Tokenizer], script_file: str) -> dict:
    """One text → 90/10 train/val by characters → `train.bin`, `val.bin` (uint16) and meta.json."""
    out_dir = script_out_dir(cfg.out_dir, script_file)
    text = read_text_source(cfg.input, out_dir, SHAKESPEARE_URL)
    start = time.perf_counter()
    tok = make_tokenizer(text)
    train, val = split_text(text, 0.9)
    if not train or not val:
        raise UserError(f"the input text has {len(text)} characters, too few for a train and a val split "
                        f"(90/10); pass a longer --input")
    meta = write_dataset(out_dir, tok.meta(), {"train": tok.encode(train), "val": tok.encode(val)},
                         source=cfg.input or str(out_dir / "input.txt"))
    seconds = time.perf_counter() - start
    print(f"vocab_size {tok.vocab_size}: wrote {meta['train_tokens']:,} train and {meta['val_tokens']:,} val "
          f"tokens to {out_dir} in {seconds:.1f}s")
    return meta


_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}


def load_text_dataset(hub_name: str, hub_config: str | None, data_files: str | None, num_proc: int,
                      cache_dir: str | None):
    """A datasets.Dataset with a `text` column: from local `data_files`, else from the Hugging Face hub."""
    if data_files is not None:
        files = []
        for pattern in (p.strip() for p in data_files.split(",") if p.strip()):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise UserError(f"--data_files: no file matches '{pattern}'")
            files += matches
        kinds = {_BUILDERS.get(Path(f).suffix.lower()) for f in files}
        if None in kinds or len(kinds) != 1:
            raise UserError(f"--data_files must all be one kind of {', '.join(_BUILDERS)}, got {data_files}")
        builder = kinds.pop()
        extra = {"sample_by": "document"} if builder == "text" else {}
        source, args = data_files, dict(path=builder, data_files=files, **extra)
    else:
        source, args = hub_name + (f" ({hub_config})" if hub_config else ""), dict(path=hub_name, name=hub_config)
    import datasets  # here: importing it takes seconds, and only the web corpora need it

    try:
        ds = datasets.load_dataset(**args, split="train", num_proc=num_proc, cache_dir=cache_dir)
    except Exception as e:  # network, hub, or file format: one line, and how to go local
        raise UserError(f"could not load {source}: {type(e).__name__}: {first_line(e)}; "
                        f"to use local files pass --data_files=a.parquet,b.parquet") from None
    if "text" not in ds.column_names:
        raise UserError(f"{source} has columns {ds.column_names}, but no 'text' column")
    return ds


def _gpt2_tokenize_batch(batch: dict) -> dict:
    # Runs in datasets' worker processes. <|endoftext|> after every document marks where it ends,
    # as in GPT-2's own training data. A plain loop, not tiktoken's threaded encode_batch: the
    # parallelism is num_proc processes, and threads on top of them only contend for the cores.
    tok = GPT2Tokenizer()
    ids = [tok.encode(text) + [tok.eot_token] for text in batch["text"]]
    return {"ids": ids, "len": [len(d) for d in ids]}


def tokenize_documents(ds, num_proc: int, desc: str = "tokenizing"):
    """GPT-2 BPE each document of `ds` (column `text`) into columns `ids` (uint16, EOT appended) and `len`."""
    import datasets

    tok = GPT2Tokenizer()  # here, not only in the workers: a missing BPE file fails once, with one line
    if tok.vocab_size > np.iinfo(np.uint16).max + 1:
        raise UserError(f"vocab_size {tok.vocab_size} does not fit uint16 token files")
    features = datasets.Features({"ids": datasets.List(datasets.Value("uint16")), "len": datasets.Value("int64")})
    return ds.map(_gpt2_tokenize_batch, batched=True, remove_columns=ds.column_names, features=features,
                  num_proc=min(num_proc, max(1, len(ds))), desc=desc)


def write_token_shards(tokenized, out_dir: str | os.PathLike, split: str, shard_tokens: int) -> int:
    """Concatenate the `ids` of a tokenized dataset into `{split}_*.bin` shards; return the token count."""
    import pyarrow.compute as pc
    from tqdm import tqdm

    total = pc.sum(tokenized.with_format("arrow")["len"]).as_py() or 0
    with ShardWriter(out_dir, split, shard_tokens) as writer, \
            tqdm(total=total, unit="tok", unit_scale=True, desc=f"writing {split}") as bar:
        for table in tokenized.with_format("arrow").iter(batch_size=4096):
            ids = table.column("ids").combine_chunks().flatten().to_numpy()
            writer.write(ids)
            bar.update(ids.size)
    return writer.num_tokens


def prepare_web_corpus(cfg: WebPrepareConfig, hub_name: str, hub_config: str | None, script_file: str) -> dict:
    """Load → split off val → tokenize (num_proc workers) → uint16 shards → meta.json; print tokens/s."""
    out_dir = script_out_dir(cfg.out_dir, script_file)
    if cfg.data_files is None:
        GPT2Tokenizer()  # fail before a long download if the BPE file cannot be loaded
    ds = load_text_dataset(hub_name, hub_config, cfg.data_files, cfg.num_proc, cfg.cache_dir)
    if len(ds) < 2:
        raise UserError(f"the source has {len(ds)} document(s); a train and a val split need at least 2")
    start = time.perf_counter()
    splits = ds.train_test_split(test_size=cfg.val_fraction, seed=cfg.seed, shuffle=True)
    meta = {**GPT2Tokenizer().meta(), "dtype": "uint16",
            "source": cfg.data_files or (hub_name + (f":{hub_config}" if hub_config else ""))}
    for split, part in (("train", splits["train"]), ("val", splits["test"])):
        tokenized = tokenize_documents(part, cfg.num_proc, desc=f"tokenizing {split}")
        meta[f"{split}_tokens"] = write_token_shards(tokenized, out_dir, split, cfg.shard_tokens)
        meta[f"{split}_documents"] = len(part)
    write_json(out_dir / "meta.json", meta)
    seconds = time.perf_counter() - start
    total = meta["train_tokens"] + meta["val_tokens"]
    print(f"wrote {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens to {out_dir} "
          f"in {seconds:.1f}s: {total / seconds:,.0f} tokens/s")
    return meta
