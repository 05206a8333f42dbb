"""Tokenizers behind one small interface: encode(str) -> list[int], decode(list[int]) -> str.

Which tokenizer a dataset or checkpoint uses is an explicit field in its metadata
(meta.json, written by prepare.py and copied into every checkpoint), never guessed
from a file or folder name, and never silently swapped for another.
"""
import functools
from pathlib import Path
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


def tokenizer_from_meta(meta: dict, source: str = "metadata") -> Tokenizer:
    kind = meta.get("tokenizer")
    if kind == "char":
        if not isinstance(meta.get("itos"), list):
            raise UserError(f"{source} says tokenizer 'char' but has no 'itos' list; re-run the dataset's prepare.py")
        return CharTokenizer(meta["itos"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"{source} names tokenizer {kind!r}; expected 'char' or 'gpt2'")


# -----------------------------------------------------------------------------
# tokenizer metadata: what a checkpoint keeps of its dataset's meta.json


def tokenizer_meta(meta: dict) -> dict:
    """The part of a dataset's meta.json that rebuilds its tokenizer (copied into every checkpoint)."""
    return {k: meta[k] for k in ("tokenizer", "vocab_size", "itos", "stoi", "eot_token") if k in meta}


def check_same_tokenizer(tok: dict, data_meta: dict, data_dir: str) -> None:
    """A trained model must read the dataset through the tokenizer it was trained with."""
    if tok == tokenizer_meta(data_meta):
        return
    kind, vocab = data_meta.get("tokenizer"), data_meta.get("vocab_size")
    if (tok.get("tokenizer"), tok.get("vocab_size")) != (kind, vocab):
        raise UserError(f"the dataset in {data_dir} uses tokenizer {kind!r} with vocab {vocab}, but the checkpoint "
                        f"was trained on {tok.get('tokenizer')!r} with vocab {tok.get('vocab_size')}; use the same dataset")
    # e.g. two character vocabularies of the same size
    raise UserError(f"the dataset in {data_dir} maps tokens differently from the checkpoint's {kind!r} vocabulary "
                    "of the same size; use the dataset it was trained on")


# -----------------------------------------------------------------------------
# prompts (sample.py, plot.py)


def read_prompt(start: str) -> str:
    """The prompt text: `start` itself, or the contents of the file named by `FILE:path`."""
    if not start.startswith("FILE:"):
        return start
    path = Path(start[len("FILE:"):])
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"prompt file '{path}' is not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"cannot read prompt file '{path}' (--start=FILE:{path}): {e.strerror}") from None


def encode_prompt(tok: Tokenizer, text: str, block_size: int, truncate: bool = False) -> list[int]:
    """The prompt's token ids: at least one, at most block_size (the model's context).

    An empty prompt starts from <|endoftext|> where the tokenizer has one (how GPT-2 samples
    unconditionally). A longer prompt is an error unless `truncate`, which keeps its last tokens.
    """
    try:
        ids = tok.encode(text)
    except UserError as e:  # a char vocabulary names the characters it lacks
        raise UserError(f"the prompt cannot be encoded: {e}") from None
    if not ids:
        if tok.eot_token is None:
            raise UserError("the prompt is empty and this vocabulary has no <|endoftext|> to start from; "
                            "pass some text with --start=...")
        return [tok.eot_token]
    if len(ids) > block_size:
        if not truncate:
            raise UserError(f"the prompt is {len(ids)} tokens, longer than the model's context of {block_size}; "
                            f"shorten it, or pass --truncate_prompt=True to keep its last {block_size} tokens")
        ids = ids[-block_size:]
    return ids
