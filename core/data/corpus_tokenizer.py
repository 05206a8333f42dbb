"""The tokenizer a corpus is prepared with, named by --tokenizer (char, gpt2, bpe:VOCAB trained on the train
split, a transformers folder or a tokenizer.json) and checked before any reading; and the ids that mark
each document's start and end (a folder's BOS/EOS, else <|endoftext|>). Shared by core/data/corpus.py and
core/data/web.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterable

from core.data.chat import CHAT_TOKENS
from core.data.tokenizer import (EOT, BPETokenizer, CharTokenizer, GPT2Tokenizer, HFTokenizer, Tokenizer, check_bpe_vocab,
                                 train_bpe)
from core.errors import UserError


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
    """What a trained BPE reserves: <|endoftext|> and the chat tokens (core/data/chat.py's)."""
    return (EOT, *CHAT_TOKENS)


def make_tokenizer(spec: str, train_texts: Iterable[str] = (), chars: set[str] | None = None) -> Tokenizer:
    """The tokenizer `spec` names; a BPE is trained here on `train_texts` (the train split, streamed: a
    lazy iterable, read only for bpe:VOCAB); a char vocabulary is `chars`."""
    if spec == "char":
        return CharTokenizer.from_text("".join(chars or ()))
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
    own training data (GPT-2's BPE, a trained BPE, a char vocabulary); [] for a folder's tokenizer whose
    post-processor adds its BOS/EOS."""
    return [tok.eot_token] if document_affixes(tok) == ([], []) and tok.eot_token is not None else []
