"""Preparing token data: text sources, tokenizing, and writing token files and shards with their
meta.json, in the format core/data/loader.py reads. The data/<name>/prepare.py scripts call it.

Any text (data/text/prepare.py, and tiny Shakespeare's two scripts) goes through prepare_corpus:
files -> documents -> whole-document train/val -> a tokenizer (char, GPT-2's BPE, a BPE trained on the
train split, a folder's tokenizer.json) -> streamed encoding -> train.bin, val.bin, meta.json. The web
corpora (openwebtext, fineweb) go through prepare_web_corpus: Hugging Face datasets, whole-document
train/val, the same tokenizer choice (make_tokenizer) and document marks (document_affixes), encoding in
worker processes, shards; both end in write_meta.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import numpy as np

from core.data.loader import shard_paths
from core.errors import UserError, first_line
from core.fileio import atomic_path, fsync_dir, write_json
from core.data.tokenizer import (EOT, BPETokenizer, CharTokenizer, GPT2Tokenizer, HFTokenizer, Tokenizer, check_bpe_vocab,
                            tokenizer_from_meta, train_bpe)


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


@dataclasses.dataclass
class TextPrepareConfig:
    input: str | None = None    # a local text file; default: input.txt in out_dir, else downloaded there
    out_dir: str | None = None  # default: the prepare.py script's own folder


@dataclasses.dataclass
class WebPrepareConfig:
    data_files: str | None = None    # local parquet/json/jsonl/txt files with a `text` column (comma-separated,
                                     # globs allowed; each .txt file is one document); default: the hub dataset
    out_dir: str | None = None       # default: the prepare.py script's own folder
    tokenizer: str = "gpt2"          # gpt2 | bpe:VOCAB (trained on the train split) | a transformers folder or
                                     # tokenizer.json; as data/text/prepare.py's --tokenizer, without char
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
        # No char: its vocabulary is every character of the corpus, known only after a whole pass.
        check_tokenizer_spec(self.tokenizer, char=False)


def prepare_text_corpus(cfg: TextPrepareConfig, tokenizer: str, script_file: str) -> dict:
    """A one-file corpus (tiny Shakespeare: --input, else input.txt beside the script, else downloaded)
    through prepare_corpus: one document, so train/val are its first 90% and last 10% of characters."""
    out_dir = script_out_dir(cfg.out_dir, script_file)
    path = text_source(cfg.input, out_dir, SHAKESPEARE_URL)
    return prepare_corpus([str(path)], tokenizer, out_dir, val_fraction=0.1)


# ---------------------------------------------------------------------------------------------
# any text: files -> documents -> train/val -> tokenizer -> token files (data/text/prepare.py)

CHUNK_CHARS = 1 << 20  # characters encoded per call: a long document streams through in pieces


@dataclasses.dataclass
class Document:
    path: Path
    start: int  # byte offsets in the file
    end: int
    chars: int


@dataclasses.dataclass
class Segment:
    """Characters [begin, end) of one document, in one split."""
    doc: Document
    begin: int
    end: int
    split: str


def input_files(patterns: list[str]) -> list[Path]:
    """The files the --input values name (globs expanded, sorted), each once; a UserError for a pattern
    that matches nothing or a path that is not a file."""
    files: list[Path] = []
    for pattern in patterns:
        if not glob.has_magic(pattern) and not Path(pattern).exists():
            raise UserError(f"--input file '{pattern}' not found")
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"--input '{pattern}': no file matches")
        for m in matches:
            if not Path(m).is_file():
                raise UserError(f"--input '{m}' is not a file")
            if Path(m) not in files:
                files.append(Path(m))
    return files


def _lines(path: Path, start: int = 0, end: int | None = None) -> Iterator[tuple[int, str]]:
    """(byte offset, line) of the file from byte `start` to `end`, line endings kept (a "\r\n" stays)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read --input file '{path}': {e.strerror}") from None
    with f:
        f.seek(start)
        offset = start
        while end is None or offset < end:
            try:
                raw = f.readline()
            except OSError as e:
                raise UserError(f"cannot read --input file '{path}': {e.strerror}") from None
            if not raw:
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path} is not UTF-8 text (byte {offset + e.start}: {e.reason}); "
                                f"pass UTF-8 text files") from None
            yield offset, line
            offset += len(raw)


def scan_documents(files: list[Path], separator: str | None, chars: set | None = None) -> list[Document]:
    """The non-empty documents of `files`: each file, or with `separator` each run of lines between lines
    that are exactly `separator` (the separator lines dropped). Streams; `chars` collects the characters."""
    from tqdm import tqdm

    docs = []
    with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True, desc="reading",
              disable=None) as bar:  # None: a bar on a terminal only, so a log or an error stays clean
        for path in files:
            start, n = 0, 0
            for offset, line in _lines(path):
                bar.update(len(line.encode("utf-8")))
                if separator is not None and line.rstrip("\r\n") == separator:
                    docs += [Document(path, start, offset, n)] if n else []
                    start, n = offset + len(line.encode("utf-8")), 0
                    continue
                n += len(line)
                if chars is not None:
                    chars.update(line)
            docs += [Document(path, start, path.stat().st_size, n)] if n else []
    return docs


def split_documents(docs: list[Document], val_fraction: float, seed: int) -> list[Segment]:
    """Whole documents into train and val (val_fraction of them, at least one, chosen by seed), in corpus
    order. A corpus of one document is cut instead: its last val_fraction of characters are val."""
    if len(docs) == 1:
        doc = docs[0]
        n = int(doc.chars * (1 - val_fraction))
        if n == 0 or n == doc.chars:
            raise UserError(f"the input has {doc.chars} characters, too few for a train and a val split; "
                            f"pass a longer --input")
        return [Segment(doc, 0, n, "train"), Segment(doc, n, doc.chars, "val")]
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    val = set(np.random.default_rng(seed).permutation(len(docs))[:n_val].tolist())
    return [Segment(d, 0, d.chars, "val" if i in val else "train") for i, d in enumerate(docs)]


def segment_text(seg: Segment, chunk_chars: int | None = CHUNK_CHARS) -> Iterator[str]:
    """The segment's text in pieces of at least chunk_chars (None: one piece), each cut just after a
    newline with a non-space character on both sides ("x\n" | "y"). No pre-tokenizer split used here
    (GPT-2's regex, Llama 3's) makes a piece that crosses such a point, so the pieces encode to exactly
    the ids of the whole; a document with no such point (CRLF line ends: "\r\n" splits differently at
    the end of a piece) stays one piece."""
    buf, size, pos, next_try = [], 0, 0, chunk_chars
    for _, line in _lines(seg.doc.path, seg.doc.start, seg.doc.end):
        lo, hi = max(seg.begin - pos, 0), min(seg.end - pos, len(line))
        pos += len(line)
        if hi > lo:
            buf.append(line[lo:hi])
            size += hi - lo
        if next_try is not None and size >= next_try:
            text = "".join(buf)
            cut = max((m.end() for m in _CUT.finditer(text)), default=0)
            if cut:
                yield text[:cut]
                text = text[cut:]
            buf, size = [text], len(text)
            next_try = size + chunk_chars  # no point found: look again a chunk later, not every line
        if pos >= seg.end:
            break
    text = "".join(buf)
    if text:
        yield text


_CUT = re.compile(r"\S\n(?=\S)")


def chunks_encode_whole(tok: Tokenizer) -> bool:
    """Whether encoding text in pieces cut at "x\n" | "y" gives the ids of the whole. True for char,
    GPT-2 and trained BPEs; False for a folder's tokenizer that prepends to every call (SentencePiece's
    "▁" in Llama 2 and TinyLlama), which then encodes each document in one call."""
    if isinstance(tok, CharTokenizer):  # any cut: and the probes may hold characters it lacks
        return True
    probes = ("Hello world.\nNext line", "a\nb", "x = 1\ndef f():", "中文。\n下一行")
    return all(tok.encode(p) == tok.encode(p[:p.index("\n") + 1]) + tok.encode(p[p.index("\n") + 1:])
               for p in probes)


def check_tokenizer_spec(spec: str, char: bool = True) -> None:
    """A UserError now, before any reading, unless `spec` is char (where `char`), gpt2, bpe:VOCAB (large
    enough) or a path."""
    kinds = ("char, " if char else "") + "gpt2, bpe:VOCAB, a transformers folder or a tokenizer.json"
    if spec == "char" and not char:
        raise UserError(f"--tokenizer=char is for data/text/prepare.py; this corpus takes {kinds}")
    if spec in ("char", "gpt2"):
        return
    if spec.startswith("bpe:"):
        vocab = spec[len("bpe:"):]
        if not vocab.isdigit():
            raise UserError(f"--tokenizer=bpe:VOCAB takes a whole number of ids, e.g. bpe:8192; got {spec!r}")
        check_bpe_vocab(int(vocab), bpe_reserved())
        return
    if not Path(spec).exists():
        raise UserError(f"--tokenizer={spec}: expected {kinds}; no such file or folder")


def bpe_reserved() -> tuple[str, ...]:
    """What a trained BPE reserves: <|endoftext|> and the chat tokens (core.data.chat imports core.data.tokenizer)."""
    from core.data.chat import CHAT_TOKENS

    return (EOT, *CHAT_TOKENS)


def make_tokenizer(spec: str, train_texts: Iterable[str] = (), chars: set[str] | None = None) -> Tokenizer:
    """The tokenizer `spec` names; a BPE is trained here on `train_texts` (the train split, streamed: a
    lazy iterable, read only for bpe:VOCAB); a char vocabulary is `chars`."""
    if spec == "char":
        return CharTokenizer(sorted(chars or ()))
    if spec == "gpt2":
        return GPT2Tokenizer()
    if spec.startswith("bpe:"):
        texts = iter(train_texts)
        print(f"training a byte-level BPE of {spec[4:]} ids on the train split", file=sys.stderr)
        start = time.perf_counter()
        tok = train_bpe(texts, int(spec[4:]), bpe_reserved(), progress=sys.stderr.isatty())
        if tok.vocab_size < int(spec[4:]):
            print(f"the train split has only enough distinct pairs for {tok.vocab_size} ids", file=sys.stderr)
        print(f"trained the BPE in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        return tok
    from core.data.hf_tokenizer import load_tokenizer_json  # transformers folders only

    return load_tokenizer_json(spec)


def document_affixes(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids a folder's tokenizer.json post-processor puts before and after a text (Llama 3: its
    <|begin_of_text|> before), found by encoding a probe with and without them; ([], []) for our own."""
    if not isinstance(tok, HFTokenizer) or isinstance(tok, BPETokenizer):
        return [], []
    plain = tok.backend.encode("a", add_special_tokens=False).ids
    full = tok.backend.encode("a", add_special_tokens=True).ids
    i = next(i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain)
    return full[:i], full[i + len(plain):]


def document_joiner(tok: Tokenizer) -> list[int]:
    """What marks where a document ends when the post-processor marks nothing: <|endoftext|>, as in GPT-2's
    own training data (GPT-2's BPE, a trained BPE); [] for a char vocabulary (it has none) or a folder's
    tokenizer whose post-processor adds its BOS/EOS."""
    return [tok.eot_token] if document_affixes(tok) == ([], []) and tok.eot_token is not None else []


def token_dtype(tok: Tokenizer):
    """uint16 token files, or uint32 past 65,536 ids."""
    return np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32


def write_meta(out_dir: Path, tok: Tokenizer, meta: dict) -> dict:
    """tokenizer.json beside meta.json for a BPE or a folder's tokenizer (the same JSON meta.json holds, for
    the tools that read tokenizer.json), then meta.json, last: its token counts vouch for the token files."""
    meta = {**tok.meta(), "dtype": np.dtype(token_dtype(tok)).name, **meta}
    if isinstance(tok, HFTokenizer):
        with atomic_path(out_dir / "tokenizer.json") as tmp:
            tmp.write_text(tok.json, encoding="utf-8")
    write_json(out_dir / "meta.json", meta)
    return meta


def encode_segments(tok: Tokenizer, segments: list[Segment], files: dict[str, BinaryIO], dtype) -> dict:
    """Each segment's ids appended to its split's file; returns the token counts per split.

    Documents in a split follow each other with what the tokenizer's post-processor puts around a text
    (a folder's BOS/EOS); where it puts nothing, <|endoftext|> between them (GPT-2's BPE, a trained BPE;
    a char vocabulary has none)."""
    from tqdm import tqdm

    prefix, suffix = document_affixes(tok)
    joiner = document_joiner(tok)
    whole = chunks_encode_whole(tok)
    counts = {split: 0 for split in files}
    with tqdm(total=sum(s.end - s.begin for s in segments), unit="char", unit_scale=True, desc="tokenizing",
              disable=None) as bar:
        for seg in segments:
            f = files[seg.split]
            head = (joiner if counts[seg.split] else []) + (prefix if seg.begin == 0 else [])
            ids = [_checked_ids(head, dtype, seg.split)] if head else []
            for text in segment_text(seg, CHUNK_CHARS if whole else None):
                ids.append(_checked_ids(tok.encode(text), dtype, f"{seg.split}.bin"))
                bar.update(len(text))
            if seg.end == seg.doc.chars and suffix:
                ids.append(_checked_ids(suffix, dtype, seg.split))
            for arr in ids:
                arr.tofile(f)
                counts[seg.split] += arr.size
    return counts


def prepare_corpus(inputs: list[str], tokenizer: str, out_dir: str | os.PathLike, val_fraction: float = 0.1,
                   seed: int = 1337, separator: str | None = None) -> dict:
    """Text files -> documents -> whole-document train/val -> tokenizer -> train.bin, val.bin (uint16, or
    uint32 past 65,536 ids), tokenizer.json (for a BPE or a folder's tokenizer) and meta.json, written last.

    Streams: the files are read a line at a time (once to find the documents, once to train a BPE, once
    to encode), and ids go to disk as each piece is encoded. Every check (files, tokenizer, empty input)
    comes before anything is written, and the files appear whole or not at all."""
    check_tokenizer_spec(tokenizer)
    files = input_files(inputs)
    chars: set[str] = set()
    docs = scan_documents(files, separator, chars if tokenizer == "char" else None)
    if not docs:
        raise UserError(f"the input ({', '.join(map(str, files))}) holds no text; nothing written")
    segments = split_documents(docs, val_fraction, seed)
    start = time.perf_counter()
    train_texts = (text for seg in segments if seg.split == "train" for text in segment_text(seg))
    tok = make_tokenizer(tokenizer, train_texts, chars)
    dtype = token_dtype(tok)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        paths = {split: stack.enter_context(atomic_path(out_dir / f"{split}.bin")) for split in ("train", "val")}
        handles = {split: stack.enter_context(open(p, "wb")) for split, p in paths.items()}
        counts = encode_segments(tok, segments, handles, dtype)
        for f in handles.values():
            f.close()
    for split in ("train", "val"):
        for stale in shard_paths(out_dir, split):  # from an earlier sharded prepare into this folder
            stale.unlink()
    meta = {"train_tokens": counts["train"], "val_tokens": counts["val"],
            "train_documents": sum(s.split == "train" for s in segments),
            "val_documents": sum(s.split == "val" for s in segments), "source": [str(p) for p in files]}
    if separator is not None:
        meta["separator"] = separator
    meta = write_meta(out_dir, tok, meta)
    split_how = "whole documents" if len(docs) > 1 else "the last characters of its one document"
    print(f"{tok.meta()['tokenizer']} vocab_size {tok.vocab_size}: {meta['train_tokens']:,} train and "
          f"{meta['val_tokens']:,} val tokens ({meta['dtype']}; val: {split_how}) to {out_dir} in "
          f"{time.perf_counter() - start:.1f}s")
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


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(meta_json: str) -> tuple[Tokenizer, list[int], list[int]]:
    """The tokenizer and the ids put before and after each document, built once per worker process."""
    tok = tokenizer_from_meta(json.loads(meta_json))
    prefix, suffix = document_affixes(tok)
    return tok, prefix, suffix + document_joiner(tok)


def _tokenize_batch(batch: dict, meta_json: str) -> dict:
    # Runs in datasets' worker processes, which rebuild the tokenizer once from its metadata (a string, sent
    # with each worker's job and part of datasets' cache fingerprint: another tokenizer never reuses a cached
    # encoding).
    # Each document is whole with its marks (a folder's BOS/EOS, else <|endoftext|> after it): the shuffled
    # split puts any document next to any other. A plain loop, not a threaded batch encode: the
    # parallelism is num_proc processes, and threads on top of them only contend for the cores.
    tok, before, after = _worker_tokenizer(meta_json)
    ids = [before + tok.encode(text) + after for text in batch["text"]]
    return {"ids": ids, "len": [len(d) for d in ids]}


def tokenize_documents(ds, tok: Tokenizer, num_proc: int, desc: str = "tokenizing"):
    """Each document of `ds` (column `text`) into columns `ids` (uint16 or uint32, with its marks) and `len`."""
    import datasets

    features = datasets.Features({"ids": datasets.List(datasets.Value(np.dtype(token_dtype(tok)).name)),
                                  "len": datasets.Value("int64")})
    return ds.map(_tokenize_batch, batched=True, remove_columns=ds.column_names, features=features,
                  fn_kwargs={"meta_json": json.dumps(tok.meta(), sort_keys=True)},
                  num_proc=min(num_proc, max(1, len(ds))), desc=desc)


def dataset_texts(ds, batch_size: int = 1024) -> Iterator[str]:
    """The `text` column of a datasets.Dataset, a batch at a time from its memory-mapped Arrow files."""
    for batch in ds.select_columns(["text"]).iter(batch_size=batch_size):
        yield from batch["text"]


def write_token_shards(tokenized, out_dir: str | os.PathLike, split: str, shard_tokens: int, dtype) -> int:
    """Concatenate the `ids` of a tokenized dataset into `{split}_*.bin` shards; return the token count."""
    import pyarrow.compute as pc
    from tqdm import tqdm

    total = pc.sum(tokenized.with_format("arrow")["len"]).as_py() or 0
    with ShardWriter(out_dir, split, shard_tokens, dtype) as writer, \
            tqdm(total=total, unit="tok", unit_scale=True, desc=f"writing {split}", disable=None) as bar:
        for table in tokenized.with_format("arrow").iter(batch_size=4096):
            ids = table.column("ids").combine_chunks().flatten().to_numpy()
            writer.write(ids)
            bar.update(ids.size)
    return writer.num_tokens


def prepare_web_corpus(cfg: WebPrepareConfig, hub_name: str, hub_config: str | None, script_file: str) -> dict:
    """Load → split off val (whole documents) → the tokenizer (a BPE trained on the train split, streamed)
    → tokenize (num_proc workers) → shards → tokenizer.json and meta.json; print tokens/s."""
    out_dir = script_out_dir(cfg.out_dir, script_file)
    trained = cfg.tokenizer.startswith("bpe:")
    tok = None if trained else make_tokenizer(cfg.tokenizer)  # a missing BPE file or bad folder: before a download
    ds = load_text_dataset(hub_name, hub_config, cfg.data_files, cfg.num_proc, cfg.cache_dir)
    if len(ds) < 2:
        raise UserError(f"the source has {len(ds)} document(s); a train and a val split need at least 2")
    start = time.perf_counter()
    splits = ds.train_test_split(test_size=cfg.val_fraction, seed=cfg.seed, shuffle=True)
    if trained:
        tok = make_tokenizer(cfg.tokenizer, dataset_texts(splits["train"]))
    meta = {"source": cfg.data_files or (hub_name + (f":{hub_config}" if hub_config else ""))}
    for split, part in (("train", splits["train"]), ("val", splits["test"])):
        tokenized = tokenize_documents(part, tok, cfg.num_proc, desc=f"tokenizing {split}")
        meta[f"{split}_tokens"] = write_token_shards(tokenized, out_dir, split, cfg.shard_tokens, token_dtype(tok))
        meta[f"{split}_documents"] = len(part)
    meta = write_meta(out_dir, tok, meta)
    seconds = time.perf_counter() - start
    total = meta["train_tokens"] + meta["val_tokens"]
    print(f"{meta['tokenizer']} vocab_size {tok.vocab_size}: wrote {meta['train_tokens']:,} train and "
          f"{meta['val_tokens']:,} val tokens ({meta['dtype']}) to {out_dir} in {seconds:.1f}s: "
          f"{total / seconds:,.0f} tokens/s")
    return meta
