"""Token data on disk: writing it (prepare.py scripts) and reading batches from it (train.py).

A prepared dataset is a folder holding meta.json (tokenizer, vocab_size, dtype, token counts)
and, per split, either one `{split}.bin` or shards `{split}_000000.bin`, `{split}_000001.bin`, ...:
raw little-endian token ids of meta's dtype, documents back to back.

    x, y = TokenData("data/shakespeare_char", "train", block_size=256).get_batch(
        64, batch_generator(seed, "train", iter_num, micro_index), device)

Batches come only from the generator passed in, so the same (seed, keys) gives the same batch
on any machine and a resumed run reads exactly what the uninterrupted one would have.

A chat dataset (data/chat/prepare.py; meta.json has "chat") also holds `{split}_mask.bin` (uint8,
1 where a token is learned) and `{split}_starts.bin` (int64 conversation offsets). Its batch rows start
at conversation starts and run on through the following conversations (packed), padded past the end
of the split; targets whose mask is 0 are -1, which the loss ignores.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import operator
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from core.errors import UserError, first_line
from core.fileio import atomic_path, fsync_dir, write_json
from core.tokenizer import GPT2Tokenizer, Tokenizer

if TYPE_CHECKING:  # torch is imported where batches are made: prepare.py scripts run without it (2 s faster)
    import torch

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


# ---------------------------------------------------------------------------------------------
# metadata and writing


def read_meta(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"{path} not found; run the dataset's prepare.py (python {Path(data_dir) / 'prepare.py'})")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-run the dataset's prepare.py") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a {type(meta).__name__}, expected a JSON object; "
                        f"re-run the dataset's prepare.py")
    return meta


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


def _shard_paths(data_dir: Path, split: str) -> list[Path]:
    """`{split}_NNNNNN.bin` files in shard order (only exact matches: `train_old.bin` is not a shard)."""
    pattern = re.compile(rf"{re.escape(split)}_(\d+)\.bin")
    found = [(int(m.group(1)), p) for p in data_dir.glob(f"{split}_*.bin") if (m := pattern.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


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
        stale = _shard_paths(self.out_dir, self.split) + [self.out_dir / f"{self.split}.bin"]
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
        for stale in _shard_paths(out_dir, split):  # from an earlier sharded prepare into this folder
            stale.unlink()
    write_json(out_dir / "meta.json", meta)
    return meta


# ---------------------------------------------------------------------------------------------
# reading batches


def batch_generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU generator seeded from (seed, *keys), e.g. (seed, "train", iter_num, micro_step).

    The seed is a SHA-256 of the keys, not Python's hash() (salted per process), so it is the
    same on every machine and every run; keys are ints or strings, and 1 differs from "1".
    """
    import torch

    parts = [operator.index(seed)] + [k if isinstance(k, str) else operator.index(k) for k in keys]
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") >> 1)  # 63 bits: any torch accepts it
    return gen


class TokenData:
    """One split of a prepared dataset, memory-mapped, validated when constructed."""

    def __init__(self, data_dir: str | os.PathLike, split: str, block_size: int, vocab_size: int | None = None,
                 loss_mask: bool = True):
        self.data_dir, self.split, self.block_size = Path(data_dir), split, block_size
        meta = read_meta(data_dir)
        meta_path = self.data_dir / "meta.json"
        if meta.get("dtype") not in TOKEN_DTYPES:
            raise UserError(f"{meta_path} has dtype {meta.get('dtype')!r}, expected one of {list(TOKEN_DTYPES)}; "
                            f"re-run the dataset's prepare.py")
        self.dtype = np.dtype(TOKEN_DTYPES[meta["dtype"]])
        if vocab_size is not None:
            data_vocab = meta.get("vocab_size")
            if not isinstance(data_vocab, int):
                raise UserError(f"{meta_path} has no integer vocab_size; re-run the dataset's prepare.py")
            if data_vocab > vocab_size:
                raise UserError(f"{meta_path} has vocab_size {data_vocab}, larger than the model's vocab_size "
                                f"{vocab_size}; token ids would index past the embedding table")
        self.paths = self._find_files()
        self.sizes = [self._count_tokens(p) for p in self.paths]
        self.num_tokens = sum(self.sizes)
        expected = meta.get(f"{split}_tokens")
        if expected is not None and expected != self.num_tokens:
            raise UserError(f"{self._describe()} holds {self.num_tokens} tokens but {meta_path} says {expected}; "
                            f"the files are stale or a prepare was interrupted: re-run the dataset's prepare.py")
        # A window is block_size + 1 consecutive tokens inside one file; starts are drawn uniformly
        # over all of them, so every token position is equally likely whatever the sharding.
        self.windows = np.array([max(0, n - block_size) for n in self.sizes], dtype=np.int64)
        if self.windows.sum() == 0 and "chat" not in meta:  # chat rows are padded: any length will do
            where = "" if len(self.paths) == 1 else " in its largest shard"
            raise UserError(f"{self._describe()} has {max(self.sizes)} tokens{where}, fewer than block_size + 1 = "
                            f"{block_size + 1}; use a smaller block_size or more data")
        self._ends = np.cumsum(self.windows)
        # chat: conversation starts, and the loss mask (None: every target counts)
        self.starts, self.mask_path = None, None
        if "chat" in meta:
            self.starts, self.mask_path = self._chat_files(meta_path)
            if not loss_mask:
                self.mask_path = None

    def _chat_files(self, meta_path: Path) -> tuple[np.ndarray, Path]:
        mask_path, starts_path = (self.data_dir / f"{self.split}_{kind}.bin" for kind in ("mask", "starts"))
        for path in (mask_path, starts_path):
            if not path.is_file():
                raise UserError(f"{path} not found, but {meta_path} says this is a chat dataset; "
                                f"re-run data/chat/prepare.py")
        if len(self.paths) != 1 or mask_path.stat().st_size != self.num_tokens:
            raise UserError(f"{mask_path} does not hold one byte per token of {self._describe()}; "
                            f"re-run data/chat/prepare.py")
        starts = np.fromfile(starts_path, dtype=np.int64)
        if starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= self.num_tokens:
            raise UserError(f"{starts_path} is not an increasing list of offsets into {self._describe()}; "
                            f"re-run data/chat/prepare.py")
        return starts, mask_path

    def _describe(self) -> str:
        return str(self.paths[0]) if len(self.paths) == 1 else str(self.data_dir / f"{self.split}_*.bin")

    def _find_files(self) -> list[Path]:
        single, shards = self.data_dir / f"{self.split}.bin", _shard_paths(self.data_dir, self.split)
        if single.exists() and shards:
            raise UserError(f"{self.data_dir} holds both {single.name} and {len(shards)} {self.split}_*.bin shards; "
                            f"remove the stale ones or re-run the dataset's prepare.py")
        if shards:
            return shards
        if not single.exists():
            raise UserError(f"{single} not found; run the dataset's prepare.py (python {self.data_dir / 'prepare.py'})")
        return [single]

    def _count_tokens(self, path: Path) -> int:
        nbytes = path.stat().st_size
        if nbytes == 0:
            raise UserError(f"{path} is empty; re-run the dataset's prepare.py")
        if nbytes % self.dtype.itemsize:
            raise UserError(f"{path} has {nbytes} bytes, not a whole number of {self.dtype.itemsize}-byte "
                            f"{self.dtype.name} tokens; it is truncated or not a token file: re-run prepare.py")
        return nbytes // self.dtype.itemsize

    def get_batch(self, batch_size: int, generator: torch.Generator,
                  device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: x (B, T) int64 and targets y (B, T), the same windows shifted one token on."""
        import torch

        if self.starts is not None:
            x, y = self._chat_batch(batch_size, generator)
            return _to_device(x, y, device)
        T = self.block_size
        flat = torch.randint(int(self._ends[-1]), (batch_size,), generator=generator).numpy()
        file_idx = np.searchsorted(self._ends, flat, side="right")
        starts = flat - (self._ends[file_idx] - self.windows[file_idx])
        buf = np.empty((batch_size, T + 1), dtype=np.int64)
        for f in np.unique(file_idx):
            # A fresh memmap per batch: one kept open holds every page it ever touched as resident
            # memory, which grows toward the file size (nanoGPT's note on the memmap leak).
            mm = np.memmap(self.paths[f], dtype=self.dtype, mode="r")
            for row in np.flatnonzero(file_idx == f):
                buf[row] = mm[starts[row]: starts[row] + T + 1]
            del mm
        xy = torch.from_numpy(buf)
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T), (B, T)
        return _to_device(x, y, device)

    def _chat_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows from random conversation starts: x (B, T) and y (B, T), y = -1 where not learned or padding."""
        import torch

        T, n = self.block_size, self.num_tokens
        picks = self.starts[torch.randint(len(self.starts), (batch_size,), generator=generator).numpy()]
        buf = np.zeros((batch_size, T + 1), dtype=np.int64)
        learned = np.zeros((batch_size, T + 1), dtype=bool)
        mm = np.memmap(self.paths[0], dtype=self.dtype, mode="r")
        mask = None if self.mask_path is None else np.memmap(self.mask_path, dtype=np.uint8, mode="r")
        for row, s in enumerate(picks):
            e = min(s + T + 1, n)  # past the split's end: padding, never learned
            buf[row, :e - s] = mm[s:e]
            learned[row, :e - s] = True if mask is None else mask[s:e].astype(bool)
        del mm, mask
        x = torch.from_numpy(buf[:, :-1].copy())                                   # (B, T)
        y = torch.from_numpy(apply_loss_mask(buf[:, 1:], learned[:, 1:]).copy())  # (B, T)
        return x, y


def apply_loss_mask(targets: np.ndarray, learned: np.ndarray) -> np.ndarray:
    """Targets with -1 where not learned: cross_entropy's ignore_index leaves them out of the loss and of
    its mean (a zeroed target would still be learned, as token 0, and count in the mean)."""
    return np.where(learned, targets, -1)


def _to_device(x: torch.Tensor, y: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        # Pinned host memory lets the copy run asynchronously, overlapping the forward pass.
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


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
