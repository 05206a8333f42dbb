"""Token data on disk, read (writing it is core/data/writer.py's): memory-mapped token files and shards -> batches.

A prepared dataset is a folder of meta.json (tokenizer, vocab_size, dtype, token counts; or nanoGPT's meta.pkl) and,
per split, one `{split}.bin` or shards `{split}_000000.bin`, ...: little-endian ids of meta's dtype, back to back.

    x, y = TokenData("data/shakespeare_char", "train", block_size=256).get_batch(
        64, batch_generator(seed, "train", iter_num, micro_index), device)

Batches come only from the generator passed in: the same (seed, keys) gives the same batch on any machine and resume.

A chat dataset (meta.json has "chat") also holds `{split}_mask.bin` and `{split}_starts.bin`; its rows start at a
conversation and run on, packed, with unlearned targets -1 (docs/chat.md).
"""
from __future__ import annotations

import hashlib
import json
import operator
import os
import pickle
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from core.errors import UserError, first_line

if TYPE_CHECKING:  # torch is imported where batches are made: prepare.py scripts, which read
    # shard_paths through core/data/writer.py and corpus.py, run without loading it
    import torch

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
DATA_ROOT = Path(__file__).resolve().parents[2] / "data"  # data/<name>/prepare.py, one per dataset


# ---------------------------------------------------------------------------------------------
# metadata


def read_meta(data_dir: str | os.PathLike) -> dict:
    """data_dir's meta.json, or nanoGPT's meta.pkl where there is no meta.json (read_meta_pkl)."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file() and (Path(data_dir) / "meta.pkl").is_file():
        return read_meta_pkl(Path(data_dir) / "meta.pkl")
    if not path.is_file() and (Path(data_dir) / "train.bin").is_file():  # nanoGPT's GPT-2 folders hold no meta
        gpt2 = json.dumps({"tokenizer": "gpt2", "vocab_size": 50257, "eot_token": 50256, "dtype": "uint16"})
        raise UserError(f"{path} not found, nor nanoGPT's meta.pkl; if the .bin files are nanoGPT's GPT-2 tokens (its "
                        f"openwebtext, shakespeare), describe them: echo '{gpt2}' > {shlex.quote(str(path))}")
    if not path.is_file():
        raise UserError(f"{path} not found; run the dataset's prepare.py ({_prepare_hint(Path(data_dir))})")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-run the dataset's prepare.py") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a {type(meta).__name__}, expected a JSON object; "
                        f"re-run the dataset's prepare.py")
    return meta


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes build (dicts, lists, strings, numbers, ...): a class or function a
    file names, which unpickling would import and could call with any arguments, is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def _plain(x) -> bool:
    """Whether x is made of dicts, lists, strings and ints only (what nanoGPT's meta.pkl holds)."""
    if isinstance(x, (dict, list)):
        return all(_plain(k) and _plain(v) for k, v in (x.items() if isinstance(x, dict) else enumerate(x)))
    return type(x) in (str, int)


def read_meta_pkl(path: Path) -> dict:
    """nanoGPT's meta.pkl ({"vocab_size", "itos", "stoi"}: a character vocabulary, beside uint16 train.bin and
    val.bin) as meta.json's fields, unpickled by _PlainUnpickler."""
    try:
        with open(path, "rb") as f:
            meta = _PlainUnpickler(f).load()
        if not _plain(meta):
            raise pickle.UnpicklingError("it holds other objects")
    except Exception as e:  # noqa: BLE001 - any malformed pickle, one line
        raise UserError(f"{path} is not read: {first_line(e)}; a meta.pkl may hold only plain dicts, lists, strings "
                        f"and ints (nanoGPT's holds vocab_size, itos and stoi)") from None
    size, itos, stoi = (meta.get(k) if isinstance(meta, dict) else None for k in ("vocab_size", "itos", "stoi"))
    if not (type(size) is int and isinstance(itos, dict) and sorted(itos) == list(range(size))
            and stoi == {c: i for i, c in itos.items()}):
        raise UserError(f"{path} is not nanoGPT's character vocabulary: vocab_size, itos and stoi do not agree")
    return {"tokenizer": "char", "vocab_size": size, "itos": [itos[i] for i in range(size)], "stoi": stoi,
            "dtype": "uint16"}


def _prepare_hint(data_dir: Path) -> str:
    """Which prepare.py to run for data_dir: its own if it has one, else the datasets that exist."""
    if (data_dir / "prepare.py").is_file():
        return f"python {data_dir / 'prepare.py'}"
    # data/hellaswag is an eval set (eval.py --task=hellaswag), not a dataset to train on
    names = sorted(p.parent.name for p in DATA_ROOT.glob("*/prepare.py") if p.parent.name != "hellaswag")
    return (f"{data_dir} has none; prepared datasets live in data/NAME after python data/NAME/prepare.py, "
            f"NAME one of {', '.join(names)}")


def shard_paths(data_dir: Path, split: str) -> list[Path]:
    """`{split}_NNNNNN.bin` files in shard order (only exact matches: `train_old.bin` is not a shard)."""
    pattern = re.compile(rf"{re.escape(split)}_(\d+)\.bin")
    found = [(int(m.group(1)), p) for p in data_dir.glob(f"{split}_*.bin") if (m := pattern.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


# ---------------------------------------------------------------------------------------------
# reading batches


def batch_generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU generator seeded from (seed, *keys), e.g. (seed, "train", iter_num, micro_step), by a SHA-256 of the keys,
    not Python's hash() (salted per process): the same on every machine and run; 1 differs from "1"."""
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
        self.identity = [self._identity(p) for p in self.paths]  # each batch checks its files are still these
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
        self.starts, self.mask_path = self._chat_files(meta_path) if "chat" in meta else (None, None)
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
        single, shards = self.data_dir / f"{self.split}.bin", shard_paths(self.data_dir, self.split)
        if single.exists() and shards:
            raise UserError(f"{self.data_dir} holds both {single.name} and {len(shards)} {self.split}_*.bin shards; "
                            f"remove the stale ones or re-run the dataset's prepare.py")
        if shards:
            return shards
        if not single.exists():
            raise UserError(f"{single} not found; run the dataset's prepare.py (python {self.data_dir / 'prepare.py'})")
        return [single]

    @staticmethod
    def _identity(path: Path) -> tuple[int, int]:
        st = path.stat()
        return st.st_ino, st.st_size

    def _map(self, f: int) -> np.memmap:
        """File f, memory-mapped for one batch, once it is checked to be the file the run started with: one cut
        short while mapped would end the process with a bus error, and one replaced by another prepare.py would
        give other tokens in silence."""
        path = self.paths[f]
        try:
            now = self._identity(path)
        except OSError:
            now = None
        if now != self.identity[f]:
            what = "was removed" if now is None else "was replaced" if now[0] != self.identity[f][0] else \
                f"changed size ({self.identity[f][1]} bytes at the start, {now[1]} now)"
            raise UserError(f"{path} {what} while training reads it; stopped before this step, the last checkpoint "
                            f"is intact. Prepare into another folder while a run reads one, then resume")
        return np.memmap(path, dtype=self.dtype, mode="r")

    def _count_tokens(self, path: Path) -> int:
        nbytes = path.stat().st_size
        if nbytes == 0:
            raise UserError(f"{path} is empty; re-run the dataset's prepare.py")
        if nbytes % self.dtype.itemsize:
            raise UserError(f"{path} has {nbytes} bytes, not a whole number of {self.dtype.itemsize}-byte "
                            f"{self.dtype.name} tokens; it is truncated or not a token file: re-run prepare.py")
        return nbytes // self.dtype.itemsize

    def get_batch(self, batch_size: int, generator: torch.Generator, device: str | torch.device = "cpu",
                  seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: x (B, T) int64 and targets y (B, T), the same windows shifted one token on.
        T is seq_len (None: block_size). The starts are drawn as for block_size whatever T, so a shorter
        window is the first T tokens of the one block_size reads, from the same draws of the generator."""
        import torch

        T = self.block_size if seq_len is None else seq_len
        if not 1 <= T <= self.block_size:
            raise ValueError(f"seq_len must be in [1, block_size={self.block_size}], got {seq_len}")
        if self.starts is not None:
            return _to_device(*self._chat_batch(batch_size, generator, T), device)
        flat = torch.randint(int(self._ends[-1]), (batch_size,), generator=generator).numpy()
        file_idx = np.searchsorted(self._ends, flat, side="right")
        starts = flat - (self._ends[file_idx] - self.windows[file_idx])
        buf = np.empty((batch_size, T + 1), dtype=np.int64)
        for f in np.unique(file_idx):
            # A fresh memmap per batch: one kept open holds every page it ever touched as resident
            # memory, which grows toward the file size (nanoGPT's note on the memmap leak).
            mm = self._map(f)
            for row in np.flatnonzero(file_idx == f):
                buf[row] = mm[starts[row]: starts[row] + T + 1]
            del mm
        xy = torch.from_numpy(buf)
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T), (B, T)
        return _to_device(x, y, device)

    def _chat_batch(self, batch_size: int, generator: torch.Generator, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows from random conversation starts: x (B, T), y (B, T) = -1 where not learned or padding."""
        import torch

        picks = self.starts[torch.randint(len(self.starts), (batch_size,), generator=generator).numpy()]
        buf = np.zeros((batch_size, T + 1), dtype=np.int64)
        learned = np.zeros((batch_size, T + 1), dtype=bool)
        mm = self._map(0)
        mask = None if self.mask_path is None else np.memmap(self.mask_path, dtype=np.uint8, mode="r")
        for row, s in enumerate(picks):
            e = min(s + T + 1, self.num_tokens)  # past the split's end: padding, never learned
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


class TrainBatches:
    """The training micro-batches in order, each fetched (on CUDA copied asynchronously) while the previous one
    computes. Micro-batch g = rank * accum + micro is drawn from (seed, iter, g) alone, so the global batch is the same
    however many processes share it and after a resume. seq_len(iter): the window's length (None: block_size)."""

    def __init__(self, data: TokenData, seed: int, batch_size: int, accum: int, rank: int = 0, device="cpu",
                 seq_len: Callable[[int], int] | None = None):
        self.data, self.seed, self.batch_size = data, seed, batch_size
        self.accum, self.rank, self.device = accum, rank, device
        self.seq_len = seq_len or (lambda iter_num: data.block_size)
        self.ahead = None  # ((iter_num, micro), (x, y))

    def get(self, iter_num: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (iter_num, micro)
        if self.ahead is not None and self.ahead[0] == key:
            return self.ahead[1]
        return self._fetch(key)

    def prefetch_after(self, iter_num: int, micro: int) -> None:
        key = (iter_num, micro + 1) if micro + 1 < self.accum else (iter_num + 1, 0)
        self.ahead = (key, self._fetch(key))

    def _fetch(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        iter_num, micro = key
        gen = batch_generator(self.seed, "train", iter_num, self.rank * self.accum + micro)
        return self.data.get_batch(self.batch_size, gen, self.device, self.seq_len(iter_num))
