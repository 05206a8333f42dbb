"""Any text files to token files (data/text/prepare.py, and tiny Shakespeare's two scripts): files ->
documents -> whole-document train/val -> a tokenizer -> streamed encoding -> train.bin, val.bin, meta.json
(core/data/writer.py). The tokenizer (--tokenizer: char, GPT-2's BPE, a BPE trained on the train split, a
folder's tokenizer.json), checked before any reading, and the ids that mark each document (a folder's BOS/EOS,
else <|endoftext|>) are core/data/web.py's too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import numpy as np

from core.data.chat import CHAT_TOKENS
from core.data.loader import shard_paths
from core.data.tokenizer import (EOT, BPETokenizer, CharTokenizer, GPT2Tokenizer, HFTokenizer, Tokenizer,
                                 check_bpe_vocab, train_bpe)
from core.data.writer import NOTHING_REPLACED, checked_ids, script_out_dir, token_dtype, write_array, write_meta
from core.errors import UserError
from core.fileio import atomic_path, space_for

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
BPE_RESERVED = (EOT, *CHAT_TOKENS)  # what a trained BPE reserves as special tokens


# -----------------------------------------------------------------------------
# the tokenizer a corpus is prepared with, and each document's marks


def check_tokenizer_spec(spec: str, char: bool = True) -> None:
    """A UserError now, before any reading, unless `spec` is char (where `char`), gpt2, bpe:VOCAB or a path."""
    kinds = ("char, " if char else "") + "gpt2, bpe:VOCAB, a transformers folder or a tokenizer.json"
    if spec == "char" and not char:
        raise UserError(f"--tokenizer=char is for data/text/prepare.py; this corpus takes {kinds}")
    if spec in ("char", "gpt2"):
        return
    if spec.startswith("bpe:"):
        vocab = spec[len("bpe:"):]
        if not vocab.isdigit():
            raise UserError(f"--tokenizer=bpe:VOCAB takes a whole number of ids, e.g. bpe:8192; got {spec!r}")
        check_bpe_vocab(int(vocab), BPE_RESERVED)
        return
    if not Path(spec).exists():
        raise UserError(f"--tokenizer={spec}: expected {kinds}; no such file or folder")


def make_tokenizer(spec: str, train_texts: Iterable[str] = (), chars: set[str] | None = None) -> Tokenizer:
    """The tokenizer `spec` names: a BPE trained on `train_texts` (lazy, read only for bpe:VOCAB), or `chars`."""
    if spec == "char":
        return CharTokenizer.from_text("".join(chars or ()))
    if spec == "gpt2":
        return GPT2Tokenizer()
    if spec.startswith("bpe:"):
        print(f"training a byte-level BPE of {spec[4:]} ids on the train split", file=sys.stderr)
        start = time.perf_counter()
        tok = train_bpe(iter(train_texts), int(spec[4:]), BPE_RESERVED, progress=sys.stderr.isatty())
        if tok.vocab_size < int(spec[4:]):
            print(f"the train split has only enough distinct pairs for {tok.vocab_size} ids", file=sys.stderr)
        print(f"trained the BPE in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        return tok
    from core.data.hf_tokenizer import load_tokenizer_json  # transformers folders only

    return load_tokenizer_json(spec)


def chunks_encode_whole(tok: Tokenizer) -> bool:
    """Whether pieces cut at "x\n" | "y" encode to the ids of the whole: False for a folder's tokenizer that prepends
    to every call (SentencePiece's "▁" in Llama 2), which then encodes each document in one call."""
    if isinstance(tok, CharTokenizer):  # any cut: and the probes may hold characters it lacks
        return True
    probes = ("Hello world.\nNext line", "a\nb", "x = 1\ndef f():", "中文。\n下一行")
    return all(tok.encode(p) == tok.encode(p[:p.index("\n") + 1]) + tok.encode(p[p.index("\n") + 1:]) for p in probes)


def document_marks(tok: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prefix, suffix, joiner): the ids a folder's tokenizer.json post-processor puts before and after a text
    (Llama 3: its <|begin_of_text|> before), found by encoding a probe with and without them; and where it marks
    nothing (our own tokenizers), <|endoftext|> to end a document, as in GPT-2's own training data."""
    prefix, suffix = [], []
    if isinstance(tok, HFTokenizer) and not isinstance(tok, BPETokenizer):
        plain = tok.backend.encode("a", add_special_tokens=False).ids
        full = tok.backend.encode("a", add_special_tokens=True).ids
        i = next(i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain)
        prefix, suffix = full[:i], full[i + len(plain):]
    marked = prefix or suffix or tok.eot_token is None
    return prefix, suffix, [] if marked else [tok.eot_token]


# -----------------------------------------------------------------------------
# files -> documents -> train/val -> token files


@dataclasses.dataclass
class TextPrepareConfig:
    input: str | None = None    # a local text file; default: input.txt in out_dir, else downloaded there
    out_dir: str | None = None  # default: the prepare.py script's own folder


def download(url: str, timeout: float, file_name: str) -> bytes:
    """`url`'s bytes; without network, a UserError that says how to pass a local copy of `file_name`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"could not download {url} ({getattr(e, 'reason', e)}); "
                        f"pass a local copy with --input=path/to/{file_name}") from None


def prepare_text_corpus(cfg: TextPrepareConfig, tokenizer: str, script_file: str) -> dict:
    """Tiny Shakespeare (--input, else input.txt in out_dir, else downloaded there) through prepare_corpus, as one
    document: its last 10% of characters are val."""
    out_dir = script_out_dir(cfg.out_dir, script_file)
    path = Path(cfg.input) if cfg.input is not None else out_dir / "input.txt"
    if cfg.input is None and not path.is_file():
        print(f"downloading {SHAKESPEARE_URL} to {path}")
        data = download(SHAKESPEARE_URL, timeout=10.0, file_name=path.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
    return prepare_corpus([str(path)], tokenizer, out_dir, val_fraction=0.1)


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
        with open(path, "rb") as f:
            f.seek(start)
            offset = start
            while (end is None or offset < end) and (raw := f.readline()):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(f"{path} is not UTF-8 text (byte {offset + e.start}: {e.reason}); "
                                    f"pass UTF-8 text files") from None
                yield offset, line
                offset += len(raw)
    except OSError as e:  # opening or reading; never the consumer's (a generator is not handed those)
        raise UserError(f"cannot read --input file '{path}': {e.strerror}") from None


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
    """The segment's text in pieces of at least chunk_chars (None: one piece), each cut at "x\n" | "y", which no
    pre-token crosses (docs/tokenizers.md, streaming); a document with no such point (CRLF ends) stays one piece."""
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


def encode_segments(tok: Tokenizer, segments: list[Segment], files: dict[str, BinaryIO], dtype) -> dict:
    """Each segment's ids, with its document's marks, appended to its split's file -> token counts per split."""
    from tqdm import tqdm

    prefix, suffix, joiner = document_marks(tok)
    whole = chunks_encode_whole(tok)
    counts = {split: 0 for split in files}
    with tqdm(total=sum(s.end - s.begin for s in segments), unit="char", unit_scale=True, desc="tokenizing",
              disable=None) as bar:
        for seg in segments:
            head = (joiner if counts[seg.split] else []) + (prefix if seg.begin == 0 else [])
            ids = [checked_ids(head, dtype, seg.split)] if head else []
            for text in segment_text(seg, CHUNK_CHARS if whole else None):
                ids.append(checked_ids(tok.encode(text), dtype, f"{seg.split}.bin"))
                bar.update(len(text))
            if seg.end == seg.doc.chars and suffix:
                ids.append(checked_ids(suffix, dtype, seg.split))
            for arr in ids:
                write_array(files[seg.split], arr)
                counts[seg.split] += arr.size
    return counts


def prepare_corpus(inputs: list[str], tokenizer: str, out_dir: str | os.PathLike, val_fraction: float = 0.1,
                   seed: int = 1337, separator: str | None = None) -> dict:
    """Text files -> train.bin, val.bin, meta.json (last), streamed (docs/tokenizers.md). Every check comes before
    anything is written, and the files appear whole or not at all."""
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
    with space_for(out_dir, None, NOTHING_REPLACED), contextlib.ExitStack() as stack:
        paths = {split: stack.enter_context(atomic_path(out_dir / f"{split}.bin")) for split in ("train", "val")}
        handles = {split: stack.enter_context(open(p, "wb")) for split, p in paths.items()}
        counts = encode_segments(tok, segments, handles, dtype)
    for split in ("train", "val"):
        for stale in shard_paths(out_dir, split):  # from an earlier sharded prepare into this folder
            stale.unlink()
    meta = {"train_tokens": counts["train"], "val_tokens": counts["val"],
            "train_documents": sum(s.split == "train" for s in segments),
            "val_documents": sum(s.split == "val" for s in segments), "source": [str(p) for p in files]}
    meta = write_meta(out_dir, tok, meta | ({} if separator is None else {"separator": separator}))
    split_how = "whole documents" if len(docs) > 1 else "the last characters of its one document"
    print(f"{tok.meta()['tokenizer']} vocab_size {tok.vocab_size}: {meta['train_tokens']:,} train and "
          f"{meta['val_tokens']:,} val tokens ({meta['dtype']}; val: {split_how}) to {out_dir} in "
          f"{time.perf_counter() - start:.1f}s")
    return meta
