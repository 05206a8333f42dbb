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


class HFTokenizer:
    """A tokenizer.json of Hugging Face's `tokenizers` library: the tokenizer of a model imported from a
    transformers folder. The JSON itself travels in the metadata, so a checkpoint fine-tuned from the
    model decodes (and exports) with exactly the tokenizer it came with."""

    def __init__(self, tokenizer_json: str, eot_token: int | None = None, bos_token: int | None = None):
        from tokenizers import Tokenizer as Backend

        self.json = tokenizer_json
        self.backend = Backend.from_str(tokenizer_json)
        # Special tokens' text stays text (as GPT2Tokenizer's encode_ordinary): a prompt cannot inject them.
        self.backend.encode_special_tokens = True
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.eot_token = eot_token
        self.bos_token = bos_token

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids  # no post-processor BOS

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def meta(self) -> dict:
        return {"tokenizer": "hf", "vocab_size": self.vocab_size, "eot_token": self.eot_token,
                "bos_token": self.bos_token, "tokenizer_json": self.json}


def tokenizer_from_meta(meta: dict, source: str = "metadata") -> Tokenizer:
    kind = meta.get("tokenizer")
    if kind == "char":
        if not isinstance(meta.get("itos"), list):
            raise UserError(f"{source} says tokenizer 'char' but has no 'itos' list; re-run the dataset's prepare.py")
        return CharTokenizer(meta["itos"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "hf":
        if not isinstance(meta.get("tokenizer_json"), str):
            raise UserError(f"{source} says tokenizer 'hf' but holds no tokenizer_json")
        return HFTokenizer(meta["tokenizer_json"], meta.get("eot_token"), meta.get("bos_token"))
    raise UserError(f"{source} names tokenizer {kind!r}; expected 'char', 'gpt2' or 'hf'")


def check_same_ids(tok: Tokenizer, other: Tokenizer, what: str, other_what: str) -> None:
    """UserError unless the two tokenizers give every id the same text: a model and a dataset agree
    whatever each tokenizer is called (a char vocabulary exported as tokenizer.json matches its dataset)."""
    if tok.vocab_size != other.vocab_size:
        raise UserError(f"{what} has {tok.vocab_size} token ids but {other_what} has {other.vocab_size}: they were "
                        f"tokenized differently; prepare the data with the model's tokenizer")
    for i in range(tok.vocab_size):
        if tok.decode([i]) != other.decode([i]):
            raise UserError(f"{what} and {other_what} map token id {i} to different text "
                            f"({tok.decode([i])!r} vs {other.decode([i])!r}); prepare the data with the model's "
                            f"tokenizer")


# -----------------------------------------------------------------------------
# tokenizer metadata: what a checkpoint keeps of its dataset's meta.json


def tokenizer_meta(meta: dict) -> dict:
    """The part of a dataset's meta.json that rebuilds its tokenizer (copied into every checkpoint)."""
    keys = ("tokenizer", "vocab_size", "itos", "stoi", "eot_token", "bos_token", "tokenizer_json")
    return {k: meta[k] for k in keys if k in meta}


def check_same_tokenizer(tok: dict, data_meta: dict, data_dir: str) -> None:
    """A trained model must read the dataset through the tokenizer it was trained with."""
    if tok == tokenizer_meta(data_meta):
        return
    if "hf" in (tok.get("tokenizer"), data_meta.get("tokenizer")):  # a transformers folder's: compare the ids
        check_same_ids(tokenizer_from_meta(tok, "the model's tokenizer metadata"),
                       tokenizer_from_meta(data_meta, f"{data_dir}/meta.json"), "the model's tokenizer",
                       f"the dataset in {data_dir}")
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


# -----------------------------------------------------------------------------
# as Hugging Face tokenizers, for transformers folders


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 bytes to printable characters, in which byte-level BPE vocabularies
    are written (Radford et al. 2019, encoder.py): printable Latin-1 stays, the rest shifts past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair whose merge makes `token`: byte-level BPE on its bytes, with only the ranks below its own,
    stops at exactly two parts (tiktoken keeps ranks, transformers' BPE keeps the merges)."""
    rank = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
        if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not the merge of two lower-ranked tokens")
    return parts[0], parts[1]


def _gpt2_backend():
    """GPT-2's BPE as a `tokenizers` Tokenizer with the same ids, built from tiktoken's ranks."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    enc = _gpt2_encoding()
    ranks = {enc.decode_single_token_bytes(i): i for i in range(GPT2_EOT)}
    byte_char = bytes_to_unicode()
    as_text = lambda b: "".join(byte_char[x] for x in b)  # noqa: E731
    vocab = {as_text(b): i for b, i in ranks.items()}
    merges = [tuple(as_text(p) for p in _merge_of(b, ranks)) for b, i in sorted(ranks.items(), key=lambda kv: kv[1])
              if len(b) > 1]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # ByteLevel's regex is GPT-2's (the pat_str of tiktoken's r50k_base); no prefix space, as tiktoken.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return backend


def _char_backend(itos: list[str]):
    """A character vocabulary as a `tokenizers` Tokenizer: a BPE model with no merges splits text into
    characters and looks each up; Fuse joins the decoded characters with nothing between them."""
    from tokenizers import Tokenizer as Backend, decoders, models

    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(itos)}, merges=[]))
    backend.decoder = decoders.Fuse()
    return backend


def hf_backend(tok: Tokenizer, extra_special_tokens: tuple[str, ...] = ()):
    """Our tokenizer as a `tokenizers` Tokenizer with the same ids; extra special tokens (a chat
    template's) get the ids after the vocabulary's."""
    from tokenizers import AddedToken, Tokenizer as Backend

    if isinstance(tok, HFTokenizer):
        backend = Backend.from_str(tok.json)
    elif isinstance(tok, GPT2Tokenizer):
        backend = _gpt2_backend()
    elif isinstance(tok, CharTokenizer):
        backend = _char_backend(tok.itos)
    else:
        raise UserError(f"no Hugging Face form for tokenizer {type(tok).__name__}")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special_tokens])
    return backend


def save_hf_tokenizer(tok: Tokenizer, directory, model_max_length: int,
                      extra_special_tokens: tuple[str, ...] = ()) -> None:
    """tokenizer.json and tokenizer_config.json in directory, which transformers' AutoTokenizer loads
    (PreTrainedTokenizerFast) with our ids, and decodes without touching the spaces."""
    from transformers import PreTrainedTokenizerFast

    backend = hf_backend(tok, extra_special_tokens)
    eot = None if tok.eot_token is None else backend.id_to_token(tok.eot_token)
    bos = getattr(tok, "bos_token", None)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
        eos_token=eot, bos_token=None if bos is None else backend.id_to_token(bos))
    fast.save_pretrained(directory)


def load_hf_tokenizer(directory) -> HFTokenizer:
    """The tokenizer of a transformers folder (its tokenizer.json), with the end-of-text id from its
    generation_config.json or tokenizer_config.json."""
    import json
    from pathlib import Path

    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{directory} has no tokenizer.json; the folder needs its tokenizer "
                        "(transformers' tokenizer.save_pretrained writes it)")
    try:
        text = path.read_text(encoding="utf-8")
        tok = HFTokenizer(text)
    except Exception as e:
        raise UserError(f"{path} cannot be read as a tokenizers JSON ({type(e).__name__}); write it again") from None
    tok.eot_token, tok.bos_token = _special_ids(directory, tok)
    return tok


def _special_ids(directory, tok: HFTokenizer) -> tuple[int | None, int | None]:
    import json

    ids = {}
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text())
            for key in ("eos_token_id", "bos_token_id"):
                value = data.get(key)
                value = value[0] if isinstance(value, list) and value else value
                if isinstance(value, int) and key not in ids:
                    ids[key] = value
    config = directory / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        for key, field in (("eos_token_id", "eos_token"), ("bos_token_id", "bos_token")):
            text = data.get(field)
            text = text.get("content") if isinstance(text, dict) else text
            if key not in ids and isinstance(text, str) and tok.backend.token_to_id(text) is not None:
                ids[key] = tok.backend.token_to_id(text)
    return ids.get("eos_token_id"), ids.get("bos_token_id")
