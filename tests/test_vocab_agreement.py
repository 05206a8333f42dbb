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

TestClient = pytest.importorskip("fastapi.testclient").TestClient  # before serve.py, which imports fastapi

import export  # noqa: E402
import serve  # noqa: E402
from core.data.hf_tokenizer import load_hf_tokenizer  # noqa: E402
from core.data.tokenizer import END_OF_TEXT, CharTokenizer, GPT2Tokenizer, encode_prompt, train_bpe  # noqa: E402
from core.data.corpus import BPE_RESERVED  # noqa: E402
from core.weights import resolver  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tests.helpers import REPO_ROOT, ROMEO_JULIET, assert_user_error, needs_transformers, run_main, train_tiny, use_gpt2_bpe  # noqa: E402

transformers = needs_transformers()

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
    bpe = train_bpe([ROMEO_JULIET] * 4, 300, BPE_RESERVED, progress=False)
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


def test_char_prepare_writes_end_of_text_after_the_characters(tmp_path):
    import json as json_

    from core.data.corpus import prepare_corpus

    (tmp_path / "a.txt").write_text(ROMEO_JULIET)
    (tmp_path / "b.txt").write_text(ROMEO_JULIET[:100])
    meta = prepare_corpus([str(tmp_path / "*.txt")], "char", tmp_path / "data", val_fraction=0.5)
    chars = sorted(set(ROMEO_JULIET))
    assert meta["itos"] == chars and meta["special_tokens"] == {END_OF_TEXT: len(chars)}
    assert meta["vocab_size"] == len(chars) + 1 == json_.loads((tmp_path / "data" / "meta.json").read_text())["vocab_size"]


OLD_META = REPO_ROOT / "tests" / "fixtures" / "char_meta_before_eot.json"  # as prepare.py wrote it before


def test_a_char_run_prepared_before_end_of_text_still_trains_samples_resumes_and_exports(tmp_path):
    """The old meta.json (65-style: characters only) trains a checkpoint without the token, which samples and
    resumes as before; export.py appends <|endoftext|> and grows the head by the one row it lacks."""
    import sample
    from core.data.writer import write_tokens

    meta = json.loads(OLD_META.read_text())
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps(meta))
    tok = CharTokenizer(meta["itos"])
    n = meta["train_tokens"]
    write_tokens(data / "train.bin", tok.encode(ROMEO_JULIET[:n]))
    write_tokens(data / "val.bin", tok.encode(ROMEO_JULIET[n:]))
    assert (tok.eot_token, tok.vocab_size, meta["val_tokens"]) == (None, len(meta["itos"]), len(ROMEO_JULIET) - n)
    train_tiny(tmp_path / "out", data, max_iters=10)
    train_tiny(tmp_path / "out", data, max_iters=20, init_from="resume")
    sampled = run_main(sample.main, [f"--out_dir={tmp_path / 'out'}", "--start=ROMEO:", "--max_new_tokens=20",
                                     "--temperature=0", "--num_samples=1"])
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr
    for args, line in ((["--start="], "the prompt is empty and this vocabulary has no <|endoftext|>"),
                       (["--stop_at_eot=True"], "stop_at_eot=True needs an end-of-text token")):
        assert_user_error(run_main(sample.main, [f"--out_dir={tmp_path / 'out'}", *args]), line)
    model, run_tok, _ = resolver.load_model("resume", str(tmp_path / "out"))
    assert model.config.vocab_size == tok.vocab_size and run_tok.eot_token is None
    assert run_main(export.main, [f"--out_dir={tmp_path / 'out'}", f"--hf_dir={tmp_path / 'hf'}"]).returncode == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["vocab_size"] == tok.vocab_size + 1 and exported["eos_token_id"] == tok.vocab_size
