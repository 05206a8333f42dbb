"""tokenizer.json both ways, the same ids: our tokenizers exported (export.py), a folder's imported (--init_from=DIR).
"""
import json
from pathlib import Path

from core.errors import UserError, first_line
from core.data.tokenizer import (GPT2_EOT, CharTokenizer, GPT2Tokenizer, HFTokenizer, Tokenizer, bytes_to_unicode,
                                 gpt2_encoding)


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

    enc = gpt2_encoding()
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


def hf_backend(tok: Tokenizer, extra_special_tokens: tuple[str, ...] = ()):
    """Our tokenizer as a `tokenizers` Tokenizer with the same ids; extra_special_tokens take the ids after them."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models

    if isinstance(tok, HFTokenizer):
        backend = Backend.from_str(tok.json)
    elif isinstance(tok, GPT2Tokenizer):
        backend = _gpt2_backend()
    elif isinstance(tok, CharTokenizer):  # a BPE with no merges looks up each character; Fuse joins them back
        backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(tok.itos)}, merges=[]))
        backend.decoder = decoders.Fuse()
    else:
        raise UserError(f"no Hugging Face form for tokenizer {type(tok).__name__}")
    own = sorted(getattr(tok, "special_tokens", {}).items(), key=lambda kv: kv[1])  # e.g. a chat template's markers
    names = [n for n, _ in own] + list(extra_special_tokens)
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    wrong = {n: i for n, i in own if backend.token_to_id(n) != i}
    if wrong:  # tokenizers numbers added tokens in order, so a gap in our ids cannot be written
        raise UserError(f"special tokens {wrong} do not follow the vocabulary without gaps; tokenizer.json cannot "
                        "give them these ids")
    return backend


def save_hf_tokenizer(tok: Tokenizer, directory, model_max_length: int,
                      extra_special_tokens: tuple[str, ...] = (), chat_template: str | None = None) -> None:
    """tokenizer.json and tokenizer_config.json, which AutoTokenizer loads with our ids and decodes without touching
    the spaces; chat_template goes in the config's "chat_template", which transformers 4 and 5 both read."""
    from transformers import PreTrainedTokenizerFast

    backend = hf_backend(tok, extra_special_tokens)
    eot = None if tok.eot_token is None else backend.id_to_token(tok.eot_token)
    bos = getattr(tok, "bos_token", None)
    # With no token of their own, bos and unk name the end-of-text token, as GPT-2's own tokenizer does: CTranslate2's
    # converter copies both into its config, and its Generator refuses a null one. Nothing adds it to a prompt (no
    # post-processor; config.json's bos_token_id stays null), and no id is ever unknown to a byte-level BPE.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
        eos_token=eot, bos_token=eot if bos is None else backend.id_to_token(bos), unk_token=eot)
    fast.chat_template = chat_template
    fast.save_pretrained(directory, save_jinja_files=False)


def load_hf_tokenizer(directory) -> HFTokenizer:
    """A transformers folder's tokenizer.json, the end-of-text id from its configs (_special_ids)."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{directory} has no tokenizer.json; the folder needs its tokenizer "
                        "(transformers' tokenizer.save_pretrained writes it)")
    try:
        tok = HFTokenizer(path.read_text(encoding="utf-8"))
    except Exception as e:
        raise UserError(f"{path} cannot be read as a tokenizers JSON ({type(e).__name__}); write it again") from None
    tok.eot_token, tok.bos_token = _special_ids(directory, tok)
    return tok


def _special_ids(directory: Path, tok: HFTokenizer) -> tuple[int | None, int | None]:
    """(eos, bos): generation_config.json's id (a list's first), else config.json's, else the token that
    tokenizer_config.json names where tokenizer.json holds it."""
    configs = [json.loads(p.read_text()) if p.is_file() else {} for p in
               (directory / name for name in ("generation_config.json", "config.json", "tokenizer_config.json"))]
    found = []
    for kind in ("eos", "bos"):
        ids = [c.get(f"{kind}_token_id") for c in configs[:2]]
        text = configs[2].get(f"{kind}_token")
        text = text.get("content") if isinstance(text, dict) else text
        ids = [i[0] if isinstance(i, list) and i else i for i in ids]
        ids.append(tok.backend.token_to_id(text) if isinstance(text, str) else None)
        found.append(next((i for i in ids if isinstance(i, int)), None))
    return found[0], found[1]


def load_tokenizer_json(path) -> HFTokenizer:
    """A transformers folder's tokenizer (load_hf_tokenizer), or a tokenizer.json file on its own."""
    path = Path(path)
    if path.is_dir():
        return load_hf_tokenizer(path)
    hint = "pass a tokenizer.json that transformers or tokenizers wrote, or the folder holding it"
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a tokenizers JSON (not JSON: {first_line(e)}); {hint}") from None
    try:
        return HFTokenizer(text)
    except Exception as e:  # tokenizers' own parse error: JSON, but not a tokenizer
        raise UserError(f"{path} is not a tokenizers JSON (JSON, but not a tokenizer: {first_line(e)}); "
                        f"{hint}") from None
