"""Tokenizers behind one small interface: encode(str) -> list[int], decode(list[int]) -> str.

Which tokenizer a dataset or checkpoint uses is an explicit field in its metadata (meta.json, copied into every
checkpoint), never guessed from a file or folder name, and never silently swapped for another.

Special tokens (the chat turn markers) are ids past the ordinary ones, named in the metadata's "special_tokens".
encode() never produces them, so user text cannot forge a turn; encode_with_specials() reads a name as its id,
for the user's own prompts (docs/interop.md, "Tokenizers"). decode() writes a special id as its name.
"""
import functools
import json
import re
from pathlib import Path
from typing import Iterable, Protocol

from core.errors import UserError

GPT2_ENCODING = "r50k_base"  # tiktoken's name for GPT-2's BPE (50257 ids)
GPT2_EOT = 50256
GPT2_VOCAB = 50257  # ordinary ids 0..50256; a model's 50304 rows leave 50257..50303 free for special tokens
END_OF_TEXT = EOT = "<|endoftext|>"  # GPT-2's name; a char vocabulary holds it as a special token after its characters


class Tokenizer(Protocol):
    vocab_size: int
    eot_token: int | None
    special_tokens: dict[str, int]

    def encode(self, text: str) -> list[int]: ...
    def encode_with_specials(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def meta(self) -> dict: ...


def check_special_tokens(special: dict, n_ordinary: int, source: str = "metadata") -> dict[str, int]:
    """`special` as {name: id}, each id past the `n_ordinary` ordinary ids and used once: an id that
    meant both a character and a turn marker would let text forge the marker, or decode ambiguously."""
    if not isinstance(special, dict) or not all(isinstance(k, str) and type(v) is int for k, v in special.items()):
        raise UserError(f"{source} has special_tokens {special!r}; expected a {{name: id}} object")
    if len(set(special.values())) != len(special):
        raise UserError(f"{source} gives two special tokens the same id: {special}; re-run the dataset's prepare.py")
    clash = {k: v for k, v in special.items() if v < n_ordinary}
    if clash:
        raise UserError(f"{source} has special token ids {clash} among the {n_ordinary} ordinary ids; special "
                        f"tokens must come after them. Re-run the dataset's prepare.py")
    return dict(special)


class _Specials:
    """Special tokens in char and GPT-2 vocabularies: ids after the ordinary ones, decoded as their names."""

    def _init_specials(self, special: dict | None, n_ordinary: int, source: str) -> None:
        self.special_tokens = check_special_tokens({} if special is None else special, n_ordinary, source)
        self.special_names = {i: name for name, i in self.special_tokens.items()}
        self.vocab_size = max([n_ordinary] + [i + 1 for i in self.special_tokens.values()])

    def decode(self, ids: list[int]) -> str:
        # Runs of ordinary ids decode together: a BPE character can span several ids.
        out, run = [], []
        for i in ids:
            if i in self.special_names:
                out += [self._decode_ordinary(run), self.special_names[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self._decode_ordinary(run)

    def encode_with_specials(self, text: str) -> list[int]:
        """Each special token's name as its id (the longest first where two overlap), the text between through
        encode: what transformers does before its pre-tokenizer."""
        names = self.special_tokens | ({} if self.eot_token is None else {END_OF_TEXT: self.eot_token})
        pattern = "(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + ")"
        ids: list[int] = []
        for k, piece in enumerate(re.split(pattern, text) if names else [text]):  # odd pieces: the names matched
            ids += [names[piece]] if k % 2 else self.encode(piece) if piece else []
        return ids

    def _meta_specials(self) -> dict:
        return {"special_tokens": self.special_tokens} if self.special_tokens else {}

    @property
    def bos_token(self) -> int | None:  # GPT-2's convention: the token that separates documents also starts one
        return self.eot_token


class CharTokenizer(_Specials):
    """Character-level vocabulary; special tokens take the ids after the characters, <|endoftext|> first. One
    prepared before that has eot_token None: it still works, export.py appends one and serve.py names the lack."""

    def __init__(self, chars: list[str], special_tokens: dict[str, int] | None = None, source: str = "metadata"):
        self.itos = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos) or any(len(c) != 1 for c in self.itos):
            raise UserError("a character vocabulary must list each single character once; re-run the dataset's "
                            "prepare.py")
        self._init_specials(special_tokens, len(self.itos), source)
        self.eot_token = self.special_tokens.get(END_OF_TEXT)  # None in a vocabulary prepared without it

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The characters of `text` (ids in sorted order), then <|endoftext|>, as every other tokenizer has:
        lm_eval starts a rolling window from it, pads with it and stops generation at it."""
        chars = sorted(set(text))
        return cls(chars, {END_OF_TEXT: len(chars)})

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise UserError(f"the text has {len(unknown)} character(s) outside this {self.vocab_size}-character "
                            f"vocabulary: {', '.join(repr(c) for c in unknown[:20])}; use only characters from the "
                            f"training text")
        return [self.stoi[c] for c in text]

    def _decode_ordinary(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids)

    def meta(self) -> dict:
        return {"tokenizer": "char", "vocab_size": self.vocab_size, "itos": self.itos, "stoi": self.stoi,
                **self._meta_specials()}


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    try:
        import tiktoken
        return tiktoken.get_encoding(GPT2_ENCODING)
    except Exception as e:  # tiktoken downloads its BPE file on first use
        raise UserError(f"could not load GPT-2's BPE (tiktoken '{GPT2_ENCODING}'): {type(e).__name__}; without "
                        f"network, set TIKTOKEN_CACHE_DIR to a folder that holds the r50k_base file") from None


class GPT2Tokenizer(_Specials):
    """GPT-2's byte-level BPE through tiktoken; <|endoftext|> is id 50256. Special tokens take the
    ids after it (50257...), the slots a model padded to 50304 already has."""

    def __init__(self, special_tokens: dict[str, int] | None = None, source: str = "metadata"):
        self.enc = gpt2_encoding()
        self._init_specials(special_tokens, self.enc.n_vocab, source)
        self.eot_token = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def _decode_ordinary(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def meta(self) -> dict:
        return {"tokenizer": "gpt2", "vocab_size": self.vocab_size, "eot_token": self.eot_token} | self._meta_specials()


class StreamDecoder:
    """Token ids fed one at a time -> printable text. A byte-level token can end inside a UTF-8 character (an
    emoji is often 2-3 tokens), so ids are held while their text ends in U+FFFD: the pieces join to decode(ids)."""

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


def check_extends(base: dict, new: dict, source: str) -> None:
    """A UserError unless tokenizer metadata `new` keeps every id of `base` meaning the same (it may add
    special tokens after them): what fine-tuning a base model on a chat dataset needs."""
    same = base.get("tokenizer") == new.get("tokenizer") and all(  # a char or BPE vocabulary: the same one
        base.get(key) == new.get(key) for key in ("itos", "tokenizer_json"))
    kept = all((new.get("special_tokens") or {}).get(k) == v for k, v in (base.get("special_tokens") or {}).items())
    if not (same and kept):
        raise UserError(f"{source}: the dataset's tokenizer ({new.get('tokenizer')!r}, vocab {new.get('vocab_size')}) "
                        f"does not extend the base model's ({base.get('tokenizer')!r}, vocab {base.get('vocab_size')}); "
                        f"prepare the dataset with --tokenizer_from= the base run's out_dir")


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
        self.special_tokens: dict[str, int] = {}  # tokenizer.json's own added tokens stay inside it
        self.eot_token = eot_token
        self.bos_token = bos_token

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids  # no post-processor BOS

    def encode_with_specials(self, text: str) -> list[int]:
        """Every added token of the tokenizer.json read as its id, as transformers' AutoTokenizer reads it."""
        return self._reading_specials.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _reading_specials(self):
        return type(self.backend).from_str(self.json)  # encode_special_tokens False: an added token's text is its id

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def meta(self) -> dict:
        return {"tokenizer": "hf", "vocab_size": self.vocab_size, "eot_token": self.eot_token,
                "bos_token": self.bos_token, "tokenizer_json": self.json}


# The split before BPE: Llama 3's (GPT-4's cl100k_base), llama.cpp's "llama-bpe" (docs/tokenizers.md).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_ALPHABET = 256


def reserved_tokens(tokenizer_json: str) -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}


class BPETokenizer(HFTokenizer):
    """A byte-level BPE trained on the dataset's own text (train_bpe). Its JSON reserves <|endoftext|> and the chat
    tokens as the last ids; only those named in special_tokens are the vocabulary's (docs/tokenizers.md)."""

    def __init__(self, tokenizer_json: str, special_tokens: dict[str, int] | None = None):
        super().__init__(tokenizer_json)
        reserved = reserved_tokens(tokenizer_json)
        if EOT not in reserved:
            raise UserError(f"this BPE's tokenizer JSON reserves no {EOT}; train it again (--tokenizer=bpe:VOCAB)")
        self.eot_token = reserved[EOT]
        special = special_tokens or {}
        wrong = {k: v for k, v in special.items() if reserved.get(k) != v}
        if wrong:
            raise UserError(f"special tokens {wrong} are not the ids this BPE reserved for them "
                            f"({ {k: reserved.get(k) for k in wrong} }); re-run the dataset's prepare.py")
        self.special_tokens = dict(special)

    def meta(self) -> dict:
        return ({"tokenizer": "bpe", "vocab_size": self.vocab_size, "eot_token": self.eot_token,
                 "tokenizer_json": self.json} | ({"special_tokens": self.special_tokens} if self.special_tokens else {}))


def train_bpe(texts: Iterable[str], vocab_size: int, reserved: tuple[str, ...], progress: bool = True) -> BPETokenizer:
    """A byte-level BPE of `vocab_size` ids trained on the strings of `texts` (streamed: the trainer keeps
    only the count of each distinct pre-token): 256 byte ids, then the merges, then `reserved` as special
    tokens (the last ids). Deterministic: the same texts and vocab_size give the same merges."""
    from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    check_bpe_vocab(vocab_size, reserved)
    backend = Backend(models.BPE())  # no unknown token: every byte is in the alphabet
    backend.pre_tokenizer = pre_tokenizers.Sequence([  # as Llama 3's tokenizer.json: split, then bytes as characters
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(reserved), show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    backend.train_from_iterator(texts, trainer)
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in reserved])
    return BPETokenizer(backend.to_str())


def check_bpe_vocab(vocab_size: int, reserved: tuple[str, ...]) -> None:
    if vocab_size < BYTE_ALPHABET + len(reserved):
        raise UserError(f"a byte-level BPE needs at least {BYTE_ALPHABET + len(reserved)} ids (the {BYTE_ALPHABET} "
                        f"bytes and {len(reserved)} special tokens), got bpe:{vocab_size}; pass a larger vocabulary")


def tokenizer_from_meta(meta: dict, source: str = "metadata") -> Tokenizer:
    kind = meta.get("tokenizer")
    if kind in ("hf", "bpe") and not isinstance(meta.get("tokenizer_json"), str):
        raise UserError(f"{source} says tokenizer {kind!r} but has no tokenizer_json; re-run the dataset's prepare.py")
    if kind == "char":
        if not isinstance(meta.get("itos"), list):
            raise UserError(f"{source} says tokenizer 'char' but has no 'itos' list; re-run the dataset's prepare.py")
        return CharTokenizer(meta["itos"], meta.get("special_tokens"), source)
    if kind == "gpt2":
        return GPT2Tokenizer(meta.get("special_tokens"), source)
    if kind == "hf":
        return HFTokenizer(meta["tokenizer_json"], meta.get("eot_token"), meta.get("bos_token"))
    if kind == "bpe":
        return BPETokenizer(meta["tokenizer_json"], meta.get("special_tokens"))
    raise UserError(f"{source} names tokenizer {kind!r}; expected 'char', 'gpt2', 'bpe' or 'hf'")


def check_same_ids(tok: Tokenizer, other: Tokenizer, what: str, other_what: str) -> None:
    """UserError unless the two tokenizers give every id the same text: a model and a dataset agree
    whatever each tokenizer is called (a char vocabulary exported as tokenizer.json matches its dataset)."""
    extra = range(other.vocab_size, tok.vocab_size)  # an export's appended <|endoftext|>, say: never in the data
    if tok.vocab_size < other.vocab_size or not all(_is_special(tok, i) for i in extra):
        raise UserError(f"{what} has {tok.vocab_size} token ids but {other_what} has {other.vocab_size}: they were "
                        f"tokenized differently; prepare the data with the model's tokenizer")
    for i in range(other.vocab_size):
        if tok.decode([i]) != other.decode([i]):
            raise UserError(f"{what} and {other_what} map token id {i} to different text "
                            f"({tok.decode([i])!r} vs {other.decode([i])!r}); prepare the data with the model's "
                            f"tokenizer")


def _is_special(tok: Tokenizer, i: int) -> bool:
    if isinstance(tok, HFTokenizer):
        added = tok.backend.get_added_tokens_decoder().get(i)
        return added is not None and added.special
    return i in getattr(tok, "special_names", {})


def token_bytes(tok: Tokenizer) -> list[int]:
    """The UTF-8 bytes each id stands for, by id; 0 for a special token (it stands for no text). A byte-level
    id can hold part of a character, so this counts its bytes, never len(decode([id]))."""
    specials = set(getattr(tok, "special_tokens", {}).values()) | ({tok.eot_token} - {None})
    if isinstance(tok, CharTokenizer):
        ordinary = [len(c.encode("utf-8")) for c in tok.itos]
    elif isinstance(tok, GPT2Tokenizer):
        ordinary = [len(tok.enc.decode_single_token_bytes(i)) for i in range(GPT2_EOT)]
    elif isinstance(tok, HFTokenizer):
        ordinary = _hf_token_bytes(tok)
        specials |= {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    else:
        raise UserError(f"no byte counts for tokenizer {type(tok).__name__}")
    counts = ordinary + [0] * (tok.vocab_size - len(ordinary))
    return [0 if i in specials else n for i, n in enumerate(counts)]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 bytes to printable characters, in which byte-level BPE vocabularies
    are written (Radford et al. 2019, encoder.py): printable Latin-1 stays, the rest shifts past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}


def _hf_token_bytes(tok: "HFTokenizer") -> list[int]:
    """Byte-level vocabularies (GPT-2's, Llama 3's, Qwen's, ours) write each byte as one character of
    bytes_to_unicode's map; SentencePiece ones (Llama 2) write "<0xNN>" for a byte and "▁" for a space."""
    decoder = json.loads(tok.json).get("decoder") or {}
    byte_level = "ByteLevel" in json.dumps(decoder)
    of_char = set(bytes_to_unicode().values())
    out = []
    for i in range(tok.backend.get_vocab_size(with_added_tokens=True)):
        piece = tok.backend.id_to_token(i) or ""
        if byte_level and all(c in of_char for c in piece):
            out.append(len(piece))
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            out.append(1)
        else:
            out.append(len(piece.replace("\u2581", " ").encode("utf-8")))
    return out


# -----------------------------------------------------------------------------
# tokenizer metadata: what a checkpoint keeps of its dataset's meta.json


def tokenizer_meta(meta: dict) -> dict:
    """The part of a dataset's meta.json that rebuilds its tokenizer (copied into every checkpoint)."""
    keys = ("tokenizer", "vocab_size", "itos", "stoi", "eot_token", "special_tokens", "bos_token", "tokenizer_json")
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
    """The prompt's ids, 1 to block_size: an empty one starts from <|endoftext|> (how GPT-2 samples unconditionally);
    a longer one is an error unless `truncate`, which keeps its last tokens."""
    try:
        ids = tok.encode_with_specials(text)  # the user's own prompt: "<|endoftext|>" there is the token
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
