"""One vocabulary for a run, its server and its export: the same ids for the same text, special tokens too.

    python -m pytest tests/test_vocab_agreement.py -q

For each tokenizer kind (a character vocabulary as prepare.py now writes it, one prepared before it held
<|endoftext|>, GPT-2's BPE, a trained BPE, an imported transformers folder's), a text that spells
<|endoftext|> gets the same ids from sample.py's encoding (encode_prompt), serve.py's /tokenize, and the
export's tokenizer in transformers.AutoTokenizer; /tokenizer_info's eos_token and eos_token_id are the
export's, and lm_eval's remote tokenizer finds that id as it does (/tokenize of eos_token, first id). A
vocabulary that holds <|endoftext|> exports with exactly the run's head rows; an old character run's server
and export both append it (resolver.with_end_of_text), and its own sample.py keeps its 65 ids.
"""
import json

import pytest
import torch

import export
import serve
from core.data.hf_tokenizer import load_hf_tokenizer
from core.data.tokenizer import END_OF_TEXT, CharTokenizer, GPT2Tokenizer, encode_prompt, train_bpe
from core.data.corpus_tokenizer import bpe_reserved
from model import GPT, GPTConfig
from tests.helpers import ROMEO_JULIET, needs_transformers, use_gpt2_bpe

transformers = needs_transformers()
TestClient = pytest.importorskip("fastapi.testclient").TestClient

BLOCK = 64
TEXT = "ROMEO:\nBut, soft!" + END_OF_TEXT + "JULIET:\nO Romeo"  # a document boundary spelled out


def tokenizer(kind: str, tmp_path):
    if kind == "char":
        return CharTokenizer.from_text(ROMEO_JULIET)
    if kind == "char-old":  # a meta.json written before character vocabularies held <|endoftext|>
        return CharTokenizer(sorted(set(ROMEO_JULIET)))
    if kind == "gpt2":
        use_gpt2_bpe()
        return GPT2Tokenizer()
    bpe = train_bpe([ROMEO_JULIET] * 4, 300, bpe_reserved(), progress=False)
    if kind == "bpe":
        return bpe
    folder = tmp_path / "imported"  # kind "hf": a transformers folder's tokenizer, read back as --init_from reads it
    export.export(model_for(bpe), bpe, folder)
    return load_hf_tokenizer(folder)


def model_for(tok) -> GPT:
    torch.manual_seed(0)
    vocab = 50304 if isinstance(tok, GPT2Tokenizer) else tok.vocab_size
    return GPT(GPTConfig(block_size=BLOCK, vocab_size=vocab, n_layer=1, n_head=2, n_embd=16, bias=False)).eval()


@pytest.mark.parametrize("kind", ["char", "char-old", "gpt2", "bpe", "hf"])
def test_run_server_and_export_give_the_same_ids(kind, tmp_path):
    tok = tokenizer(kind, tmp_path)
    model = model_for(tok)
    folder = tmp_path / "export"
    export.export(model, tok, folder)
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    exported_rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    app = serve.build_app(model, tok, serve.ServeConfig(engine="thread"), "m", "cpu")
    with TestClient(app) as client:
        info = client.get("/tokenizer_info").json()
        served = client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
        first_of_eos = client.post("/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"][0]
        spoken = client.post("/detokenize", json={"tokens": served}).json()["prompt"]

    exported = auto(TEXT, add_special_tokens=False)["input_ids"]
    assert served == exported and spoken == auto.decode(exported) == TEXT
    assert (info["eos_token"], info["eos_token_id"]) == (auto.eos_token, auto.eos_token_id) == (END_OF_TEXT, first_of_eos)
    assert info["eos_token_id"] in exported  # the spelled <|endoftext|> is the token, everywhere
    if kind == "char-old":  # its own sample.py: 65 ids, as before; the server and export append the 66th
        assert tok.eot_token is None and info["vocab_size"] == tok.vocab_size + 1 == exported_rows
        assert encode_prompt(tok, "ROMEO:", BLOCK) == exported[:6]
    else:
        assert encode_prompt(tok, TEXT, BLOCK) == exported and info["eos_token_id"] == tok.eot_token
        assert exported_rows == model.config.vocab_size  # the export adds no head row
