"""Trained BPE tokenizers (core/data/tokenizer.py's train_bpe) and data/text/prepare.py, the prepare script for any text.

    python -m pytest tests/test_tokenizer.py

The corpus is a few modules of this repository (code and docstrings) plus mixed text, so the tests need
nothing beyond the repo; GPT-2's BPE comes from a tiktoken cache (tests.helpers.use_gpt2_bpe).
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.data.chat import CHAT_TOKENS, ChatTemplate, with_chat_tokens
import core.data.corpus
from core.data.loader import TokenData
from core.data.tokenizer import EOT, BPETokenizer, GPT2Tokenizer, check_extends, tokenizer_from_meta, train_bpe
from tests.helpers import REPO_ROOT, assert_user_error, needs_transformers, run_main, train_tiny, use_gpt2_bpe

RESERVED = (EOT, *CHAT_TOKENS)
# CJK, emoji (with a skin-tone modifier and a ZWJ sequence), whitespace runs, CRLF, NBSP, zero-width spaces
MIXED = ("中文測試，日本語のテキスト。한국어 😀👍🏽👩‍💻\n\t\t  indented\r\n\r\nnbsp\u00a0here\u200bzero\u200dwidth"
         "   \n\n\n  trailing  \n def f(x):\n    return 1234567 + x  # ünïcödé\n")


def corpus_texts() -> list[str]:
    return [(REPO_ROOT / name).read_text(encoding="utf-8") for name in ("model.py", "core/data/corpus.py", "core/data/loader.py")]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe(iter(corpus_texts() + [MIXED]), 600, RESERVED, progress=False)


# --- the trained BPE ------------------------------------------------------------------------------


def test_trained_bpe_layout(bpe):
    vocab = json.loads(bpe.json)["model"]["vocab"]
    assert bpe.vocab_size == 600 and len(vocab) == 600 - len(RESERVED)
    assert {bpe.backend.token_to_id(name): name for name in RESERVED} == dict(zip(range(595, 600), RESERVED))
    assert bpe.eot_token == 595 and bpe.special_tokens == {}  # a base tokenizer: no chat template
    assert ChatTemplate.for_tokenizer(bpe) is None
    pre = json.loads(bpe.json)["pre_tokenizer"]["pretokenizers"][0]
    assert pre["pattern"]["Regex"] == core.data.tokenizer.SPLIT_PATTERN  # llama.cpp's "llama-bpe" split


def test_round_trips_mixed_text(bpe):
    ids = bpe.encode(MIXED)
    assert bpe.decode(ids) == MIXED
    assert len(ids) < len(MIXED.encode("utf-8"))  # merges learned, not bytes only
    assert bpe.encode("<|endoftext|><|user|>") != [bpe.eot_token, 597]  # text cannot forge a special token


def test_training_is_deterministic_across_processes(bpe, tmp_path):
    """Same corpus and settings, same merges: in this process and in a fresh one (whose hash seeds differ)."""
    again = train_bpe(iter(corpus_texts() + [MIXED]), 600, RESERVED, progress=False)
    assert again.json == bpe.json
    script = ("import sys; sys.path.insert(0, '.'); from tests.test_tokenizer import *; "
              "sys.stdout.write(train_bpe(iter(corpus_texts() + [MIXED]), 600, RESERVED, progress=False).json)")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["model"]["merges"] == json.loads(bpe.json)["model"]["merges"]
    assert out.stdout == bpe.json
    smaller = train_bpe(iter(corpus_texts() + [MIXED]), 400, RESERVED, progress=False)
    assert json.loads(smaller.json)["model"]["merges"] == json.loads(bpe.json)["model"]["merges"][:400 - 256 - 5]


def test_metadata_round_trip_and_chat_tokens(bpe):
    meta = json.loads(json.dumps(bpe.meta()))  # as meta.json and a checkpoint carry it
    tok = tokenizer_from_meta(meta)
    assert tok.encode(MIXED) == bpe.encode(MIXED) and tok.eot_token == bpe.eot_token
    chat_meta = with_chat_tokens(meta)
    assert chat_meta["vocab_size"] == 600 and chat_meta["special_tokens"] == dict(zip(CHAT_TOKENS, range(596, 600)))
    check_extends(meta, chat_meta, "test")  # the chat vocabulary keeps every id
    template = ChatTemplate.for_tokenizer(tokenizer_from_meta(chat_meta))
    ids, mask = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert ids[0] == 597 and ids[-1] == 599 and template.tok.decode(ids) == "<|user|>hi<|end|><|assistant|>yo<|end|>"
    with pytest.raises(core.errors.UserError, match="not the ids this BPE reserved"):
        tokenizer_from_meta(meta | {"special_tokens": {"<|user|>": 3}})
    other = train_bpe(iter(corpus_texts()[:1]), 600, RESERVED, progress=False).meta()
    with pytest.raises(core.errors.UserError, match="does not extend"):
        check_extends(meta, with_chat_tokens(other), "test")


def test_bad_tokenizer_metadata_is_one_line_naming_its_source():
    with pytest.raises(core.errors.UserError, match="data/x/meta.json has special token ids"):
        tokenizer_from_meta({"tokenizer": "char", "itos": ["a", "b"], "special_tokens": {EOT: 1}}, "data/x/meta.json")
    for kind in ("hf", "bpe"):
        with pytest.raises(core.errors.UserError, match=f"data/x/meta.json says tokenizer '{kind}' but has no tokeni"):
            tokenizer_from_meta({"tokenizer": kind}, "data/x/meta.json")


def test_exported_folder_gives_the_same_ids(bpe, tmp_path):
    transformers = needs_transformers()
    from core.data.hf_tokenizer import save_hf_tokenizer

    save_hf_tokenizer(bpe, tmp_path, 1 << 20)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert auto(MIXED)["input_ids"] == bpe.encode(MIXED)
    for text in corpus_texts():  # some spell "<|endoftext|>": transformers makes that the special token unless told
        assert auto(text, split_special_tokens=True)["input_ids"] == bpe.encode(text)
    assert bpe.eot_token in auto("a<|endoftext|>b")["input_ids"] and bpe.eot_token not in bpe.encode("a<|endoftext|>b")
    assert auto.decode(bpe.encode(MIXED)) == MIXED and auto.eos_token == EOT



def test_a_folders_end_and_start_ids_come_from_its_configs_in_order(bpe, tmp_path):
    """load_hf_tokenizer's eos and bos: generation_config.json's id (a list's first), else config.json's, else
    the token tokenizer_config.json names (text or {"content": text}) where tokenizer.json holds it."""
    from core.data.hf_tokenizer import load_hf_tokenizer
    from core.data.tokenizer import reserved_tokens

    (tmp_path / "tokenizer.json").write_text(bpe.json, encoding="utf-8")
    end = reserved_tokens(bpe.json)["<|end|>"]
    write = lambda name, data: (tmp_path / name).write_text(json.dumps(data))  # noqa: E731
    assert (load_hf_tokenizer(tmp_path).eot_token, load_hf_tokenizer(tmp_path).bos_token) == (None, None)
    write("tokenizer_config.json", {"eos_token": {"content": EOT}, "bos_token": "<|end|>", "unk_token": "none"})
    assert (load_hf_tokenizer(tmp_path).eot_token, load_hf_tokenizer(tmp_path).bos_token) == (bpe.eot_token, end)
    write("tokenizer_config.json", {"eos_token": "not a token", "bos_token": "<|end|>"})
    assert (load_hf_tokenizer(tmp_path).eot_token, load_hf_tokenizer(tmp_path).bos_token) == (None, end)
    write("config.json", {"eos_token_id": 7, "bos_token_id": None})
    assert (load_hf_tokenizer(tmp_path).eot_token, load_hf_tokenizer(tmp_path).bos_token) == (7, end)
    write("generation_config.json", {"eos_token_id": [5, 7], "bos_token_id": 3})
    assert (load_hf_tokenizer(tmp_path).eot_token, load_hf_tokenizer(tmp_path).bos_token) == (5, 3)

# --- data/text/prepare.py ---------------------------------------------------------------------------


def prepare(*args):
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_text", REPO_ROOT / "data" / "text" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in args])


@pytest.fixture
def docs(tmp_path) -> list[Path]:
    texts = corpus_texts() + [MIXED, "short one\n"]
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / "in" / f"doc{i}.txt")
        paths[-1].parent.mkdir(exist_ok=True)
        paths[-1].write_bytes(text.encode("utf-8"))  # as is: the "\r\n" stays
    return paths


def read_ids(out: Path, split: str, dtype=np.uint16) -> list[int]:
    return np.fromfile(out / f"{split}.bin", dtype=dtype).tolist()


def test_text_prepare_trains_a_bpe_and_splits_whole_documents(docs, tmp_path):
    out = tmp_path / "out"
    meta = prepare(f"--input={tmp_path / 'in' / '*.txt'}", "--tokenizer=bpe:500", f"--out_dir={out}",
                   "--val_fraction=0.4")
    assert meta == json.loads((out / "meta.json").read_text())
    assert (out / "tokenizer.json").read_text() == meta["tokenizer_json"]
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("bpe", 500, "uint16")
    assert (meta["train_documents"], meta["val_documents"]) == (3, 2)
    tok = tokenizer_from_meta(meta)
    texts = {p.read_bytes().decode("utf-8") for p in docs}
    for split in ("train", "val"):
        ids = read_ids(out, split)
        assert len(ids) == meta[f"{split}_tokens"] == TokenData(out, split, 8, 500).num_tokens
        cuts = [-1] + [i for i, t in enumerate(ids) if t == tok.eot_token] + [len(ids)]  # joined by <|endoftext|>
        parts = [tok.decode(ids[a + 1:b]) for a, b in zip(cuts, cuts[1:])]
        assert len(parts) == meta[f"{split}_documents"] and set(parts) <= texts
        texts -= set(parts)
    assert texts == set()  # every document in exactly one split
    # the BPE saw the train split only: training on it alone gives the same tokenizer
    train_docs = [p.read_bytes().decode("utf-8") for p in docs
                  if p.read_bytes().decode("utf-8") in tok.decode(read_ids(out, "train"))]
    assert train_bpe(iter(train_docs), 500, RESERVED, progress=False).json == tok.json


@pytest.mark.parametrize("kind", ["gpt2", "bpe:400"])
def test_pieces_encode_to_the_ids_of_the_whole(kind, docs, tmp_path, monkeypatch):
    """A document streamed in small pieces gives exactly the ids of encoding it in one call."""
    if kind == "gpt2":
        use_gpt2_bpe()
    hard = tmp_path / "in" / "hard.txt"  # whitespace before line ends, CRLF, blank lines, punctuation at ends
    hard.write_bytes(("x  \ny\r\nz.\nw\n\n\nv'\ns\n" * 400 + MIXED * 20).encode("utf-8"))
    args = [f"--input={tmp_path / 'in' / '*.txt'}", f"--tokenizer={kind}", "--val_fraction=0.3"]
    monkeypatch.setattr(core.data.corpus, "CHUNK_CHARS", None)
    whole = prepare(*args, f"--out_dir={tmp_path / 'whole'}")
    monkeypatch.setattr(core.data.corpus, "CHUNK_CHARS", 50)
    pieces = prepare(*args, f"--out_dir={tmp_path / 'pieces'}")
    assert whole == pieces | {"source": whole["source"]}
    for split in ("train", "val"):
        assert read_ids(tmp_path / "pieces", split) == read_ids(tmp_path / "whole", split)


def test_a_large_vocabulary_writes_uint32(tmp_path):
    """A folder's tokenizer of 70,000 ids: ids past 65,535 need uint32, and TokenData reads them back."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w65536\nw2\n")
    (tmp_path / "b.txt").write_text("w3 w66000\n")
    meta = prepare(f"--input={tmp_path / 'a.txt'},{tmp_path / 'b.txt'}", f"--tokenizer={tmp_path / 'tokenizer.json'}",
                   f"--out_dir={tmp_path / 'out'}")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    ids = read_ids(tmp_path / "out", "train", np.uint32) + read_ids(tmp_path / "out", "val", np.uint32)
    assert sorted(ids) == sorted([1, 69999, 65536, 2, 3, 66000])
    assert TokenData(tmp_path / "out", "train", 1, 70_000).dtype == np.uint32


def test_a_folder_tokenizer_adds_what_its_post_processor_adds(tmp_path):
    """Llama 3's tokenizer.json puts <|begin_of_text|> before every text: each document starts with it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    backend = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "c": 3}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    for name, text in (("1", "a b\n"), ("2", "c c\n"), ("3", "b\n")):
        (tmp_path / f"{name}.txt").write_text(text)
    prepare(f"--input={tmp_path}/?.txt", f"--tokenizer={tmp_path / 'tokenizer.json'}", f"--out_dir={tmp_path / 'out'}",
            "--val_fraction=0.34")
    ids = read_ids(tmp_path / "out", "train") + read_ids(tmp_path / "out", "val")
    assert sorted([ids[i:i + 3] for i in range(0, 6, 3)] + [ids[6:]]) == [[0, 1, 2], [0, 2], [0, 3, 3]]


def test_a_prepending_tokenizer_encodes_each_document_in_one_call():
    """SentencePiece-style tokenizers (Llama 2, TinyLlama) prepend "▁" to every call: pieces would differ."""
    from tokenizers import Tokenizer, models, normalizers

    from core.data.tokenizer import HFTokenizer

    chars = sorted(set("▁Hello world.\nNext line ab x=1def f():中文。下一行"))
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, merges=[]))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert not core.data.corpus.chunks_encode_whole(HFTokenizer(backend.to_str()))
    assert core.data.corpus.chunks_encode_whole(train_bpe(iter(corpus_texts()), 300, RESERVED, progress=False))


def test_a_separator_line_splits_a_file_into_documents(tmp_path):
    use_gpt2_bpe()
    (tmp_path / "all.txt").write_text("one\n---\ntwo two\n---\n---\nthree\n")
    meta = prepare(f"--input={tmp_path / 'all.txt'}", "--separator=---", "--tokenizer=gpt2",
                   f"--out_dir={tmp_path / 'out'}", "--val_fraction=0.3")
    assert (meta["train_documents"], meta["val_documents"], meta["separator"]) == (2, 1, "---")  # the empty one dropped
    tok = GPT2Tokenizer()
    texts = [tok.decode(read_ids(tmp_path / "out", s)) for s in ("train", "val")]
    assert sorted(texts[0].split(EOT) + [texts[1]]) == ["one\n", "three\n", "two two\n"]


BAD_INPUTS = [  # (files to write, arguments, the error)
    ({}, ["--input=missing.txt"], "--input file 'missing.txt' not found"),
    ({}, ["--input=nothing/*.txt"], "no file matches"),
    ({"d/x.txt": b"x\n"}, ["--input=d"], "--input 'd' is not a file"),
    ({"bin.txt": b"ok\n\xff\xfe\n"}, ["--input=bin.txt"], "bin.txt is not UTF-8 text (byte 3"),
    ({"empty.txt": b"", "blank.txt": b""}, ["--input=empty.txt,blank.txt"], "holds no text; nothing written"),
    ({"a.txt": b"some text\n"}, ["--input=a.txt", "--tokenizer=bpe:200"], "at least 261 ids (the 256 bytes and 5"),
    ({"a.txt": b"some text\n"}, ["--input=a.txt", "--tokenizer=bpe:big"], "bpe:VOCAB takes a whole number"),
    ({"a.txt": b"some text\n", "tokenizer.json": b'{"not": "a tokenizer"}'},
     ["--input=a.txt", "--tokenizer=tokenizer.json"], "tokenizer.json is not a tokenizers JSON"),
    ({"a.txt": b"some text\n", "tok/tokenizer.json": b"[1, 2"}, ["--input=a.txt", "--tokenizer=tok"],
     "tokenizer.json cannot be read as a tokenizers JSON"),
    ({"a.txt": b"x"}, ["--input=a.txt", "--tokenizer=char"], "too few for a train and a val split"),
]


@pytest.mark.parametrize("files, args, message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_inputs_are_one_line_and_write_nothing(files, args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, data in files.items():
        Path(name).parent.mkdir(exist_ok=True)
        Path(name).write_bytes(data)
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_text", REPO_ROOT / "data" / "text" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = run_main(module.main, [*args, "--out_dir=out"])
    assert_user_error(result, message)
    assert not Path("out").exists()


# --- a trained BPE through training, sampling and export ---------------------------------------


@pytest.mark.slow
def test_a_bpe_run_samples_and_exports_its_tokenizer(docs, tmp_path):
    """train.py on a trained-BPE dataset: the checkpoint carries the tokenizer, sample.py decodes with it,
    and export.py's folder gives AutoTokenizer the same ids."""
    transformers = needs_transformers()
    import export
    import sample

    data = tmp_path / "data"
    meta = prepare(f"--input={tmp_path / 'in' / '*.txt'}", "--tokenizer=bpe:320", f"--out_dir={data}")
    train_tiny(tmp_path / "run", data, max_iters=4, eval_interval=4, bias=False)
    result = run_main(sample.main, [f"--out_dir={tmp_path / 'run'}", "--device=cpu", "--num_samples=1",
                                    "--max_new_tokens=20", f"--start={MIXED[:4]}", "--seed=1"])
    assert result.returncode in (None, 0) and result.stdout.startswith(MIXED[:4]), result.stderr
    run_main(export.main, [f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["model"] == json.loads(meta["tokenizer_json"])["model"]
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    tok = tokenizer_from_meta(meta)
    for text in (MIXED, *corpus_texts()):
        assert auto(text, split_special_tokens=True)["input_ids"] == tok.encode(text)


# --- fine-tuning an imported model on your text ----------------------------------------------------


def bos_backend(bpe: BPETokenizer):
    """The BPE as a `tokenizers` Tokenizer that, as Llama 3's, puts <|begin_of_text|> before every text;
    returns it and that BOS id."""
    from tokenizers import AddedToken, Tokenizer, processors

    backend = Tokenizer.from_str(bpe.json)
    backend.add_special_tokens([AddedToken("<|begin_of_text|>", special=True, normalized=False)])
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    return backend, bos


def write_llama_folder(path: Path, bpe: BPETokenizer) -> int:
    """A tiny random Llama from a config (sharpened attention), whose tokenizer.json is a byte-level BPE that,
    as Llama 3's, puts <|begin_of_text|> before every text; returns that BOS id."""
    transformers = needs_transformers()
    import torch

    backend, bos = bos_backend(bpe)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=80,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      bos_token_id=bos, eos_token_id=bpe.eot_token)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(30)
    model.save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                         eos_token=EOT).save_pretrained(path)
    return bos


@pytest.mark.slow
def test_fine_tune_an_imported_model_on_your_text(bpe, docs, tmp_path):
    """--tokenizer=DIR tokenizes with the folder's tokenizer (its BOS before each document), train.py
    --init_from=DIR trains on it, sample/eval use the folder's tokenizer, and the export's logits equal ours."""
    transformers = needs_transformers()
    import torch

    import eval as eval_script
    import export
    import sample
    from core.weights.resolver import load_model

    folder = tmp_path / "llama"
    bos = write_llama_folder(folder, bpe)
    data = tmp_path / "data"
    meta = prepare(f"--input={tmp_path / 'in' / '*.txt'}", f"--tokenizer={folder}", f"--out_dir={data}",
                   "--val_fraction=0.4")
    assert meta["tokenizer"] == "hf" and meta["bos_token"] == bos and (data / "tokenizer.json").is_file()
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    val = read_ids(data, "val")
    starts = [i for i, t in enumerate(val) if t == bos]
    assert starts[0] == 0 and len(starts) == meta["val_documents"] == 2  # the post-processor's BOS, per document
    docs_text = {p.read_bytes().decode("utf-8") for p in docs}
    for a, b in zip(starts, starts[1:] + [len(val)]):
        assert auto.decode(val[a + 1:b]) in docs_text
        assert val[a:b] == auto(auto.decode(val[a + 1:b]), split_special_tokens=True)["input_ids"]

    run = tmp_path / "run"
    train_tiny(run, data, init_from=str(folder), block_size=32, max_iters=6, eval_interval=6, learning_rate=1e-3)
    model, tok, _ = load_model("resume", run)
    assert tok.meta()["tokenizer_json"] == meta["tokenizer_json"]  # the checkpoint carries the folder's tokenizer
    result = run_main(sample.main, [f"--out_dir={run}", "--device=cpu", "--num_samples=1", "--max_new_tokens=8",
                                    "--start=def f(x):", "--temperature=0", "--stream=False"])
    assert result.returncode == 0 and result.stdout.startswith("def f(x):"), result.stderr
    line = run_main(eval_script.main, [f"--out_dir={run}", "--device=cpu"]).stdout
    assert "bits/byte" in line and f"{data} val" in line
    result = run_main(export.main, [f"--out_dir={run}", f"--hf_dir={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.tensor([val[:32]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(idx)[0], theirs(idx).logits, atol=1e-5, rtol=1e-5)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert again("def f(x):")["input_ids"] == auto("def f(x):")["input_ids"] == [bos] + tok.encode("def f(x):")


def test_a_dataset_of_another_tokenizer_is_one_line_for_an_imported_model(bpe, docs, tmp_path):
    import train

    folder = tmp_path / "llama"
    write_llama_folder(folder, bpe)
    other = train_bpe(iter(corpus_texts()[:1]), bpe.vocab_size, RESERVED, progress=False)  # same size, other merges
    (tmp_path / "other.json").write_text(other.json)
    prepare(f"--input={tmp_path / 'in' / '*.txt'}", f"--tokenizer={tmp_path / 'other.json'}",
            f"--out_dir={tmp_path / 'data'}")
    result = run_main(train.main, [f"--init_from={folder}", f"--data_dir={tmp_path / 'data'}",
                                   f"--out_dir={tmp_path / 'run'}", "--device=cpu", "--dtype=float32",
                                   "--compile=False", "--max_iters=1", "--block_size=16", "--batch_size=2"])
    assert_user_error(result, "prepare the data with the model's tokenizer")
