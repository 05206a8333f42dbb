"""Tokenizers behind one small interface: encode(str) -> list[int], decode(list[int]) -> str.

Which tokenizer a dataset or checkpoint uses is an explicit field in its metadata
(meta.json, written by prepare.py and copied into every checkpoint), never guessed
from a file or folder name, and never silently swapped for another.
"""
import functools
from typing import Protocol

from core.errors import UserError

GPT2_ENCODING = "r50k_base"  # tiktoken's name for GPT-2's BPE (50257 ids)
GPT2_EOT = 50256


class Tokenizer(Protocol):
    vocab_size: int
    eot_token: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def meta(self) -> dict: ...


class CharTokenizer:
    """Character-level vocabulary, built from the characters of a text."""

    def __init__(self, chars: list[str]):
        self.itos = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.vocab_size = len(self.itos)
        self.eot_token = None

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            shown = ", ".join(repr(c) for c in unknown[:20])
            raise UserError(
                f"the text has {len(unknown)} character(s) outside this {self.vocab_size}-character vocabulary: "
                f"{shown}; use only characters from the training text"
            )
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids)

    def meta(self) -> dict:
        return {
            "tokenizer": "char",
            "vocab_size": self.vocab_size,
            "itos": self.itos,
            "stoi": self.stoi,
        }


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
    try:
        import tiktoken
        return tiktoken.get_encoding(GPT2_ENCODING)
    except Exception as e:  # tiktoken downloads its BPE file on first use
        raise UserError(
            f"could not load GPT-2's BPE (tiktoken '{GPT2_ENCODING}'): {type(e).__name__}; without network, "
            "set TIKTOKEN_CACHE_DIR to a folder that holds the r50k_base file"
        ) from None


class GPT2Tokenizer:
    """GPT-2's byte-level BPE through tiktoken; <|endoftext|> is id 50256."""

    def __init__(self):
        self.enc = _gpt2_encoding()
        self.vocab_size = self.enc.n_vocab
        self.eot_token = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def meta(self) -> dict:
        return {"tokenizer": "gpt2", "vocab_size": self.vocab_size, "eot_token": self.eot_token}


class StreamDecoder:
    """Turn token ids, fed one at a time, into text that can be printed as it comes.

    A byte-level BPE token can end inside a multi-byte UTF-8 character (an emoji is often two or
    three tokens), and decoding it alone gives U+FFFD. Ids are held back while their text ends in
    U+FFFD, so the printed pieces always join up to exactly tok.decode(all ids).
    """

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.pending: list[int] = []

    def push(self, token: int) -> str:
        self.pending.append(token)
        text = self.tok.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        text = self.tok.decode(self.pending) if self.pending else ""
        self.pending = []
        return text


def tokenizer_from_meta(meta: dict, source: str = "metadata") -> Tokenizer:
    kind = meta.get("tokenizer")
    if kind == "char":
        if not isinstance(meta.get("itos"), list):
            raise UserError(f"{source} says tokenizer 'char' but has no 'itos' list; re-run the dataset's prepare.py")
        return CharTokenizer(meta["itos"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"{source} names tokenizer {kind!r}; expected 'char' or 'gpt2'")
