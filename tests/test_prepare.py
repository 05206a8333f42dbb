"""The data/<name>/prepare.py scripts, run on small local input in temporary folders.

    python -m pytest tests/test_prepare.py

Tiny Shakespeare comes from tests.helpers.SHAKESPEARE (copied into a temp folder) and GPT-2's BPE from a
tiktoken cache (tests.helpers.use_gpt2_bpe); tests that need them are skipped, saying how to provide
them, where they are absent.
"""
import importlib.util
import inspect
import io
import json
import shutil
import urllib.error
from pathlib import Path

import numpy as np
import pytest

import core.data.corpus
from core.data.loader import TokenData
from core.data.tokenizer import EOT, CharTokenizer, GPT2Tokenizer, tokenizer_from_meta, train_bpe
from core.errors import UserError
from tests.helpers import NO_SHAKESPEARE, SHAKESPEARE, assert_user_error, run_scripts, use_gpt2_bpe

ROOT = Path(__file__).resolve().parents[1]
CORPUS = SHAKESPEARE

DOCS = ["First document.", "Zweites Dokument: ünïcödé ✓", "", "line one\nline two\n\n", "  spaces  ", "end"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", ROOT / "data" / name / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_split(out_dir: Path, split: str, dtype=np.uint16) -> np.ndarray:
    files = sorted(out_dir.glob(f"{split}.bin")) or sorted(out_dir.glob(f"{split}_*.bin"))
    return np.concatenate([np.fromfile(f, dtype=dtype) for f in files])


@pytest.fixture
def corpus(tmp_path) -> Path:
    if not CORPUS.is_file():
        pytest.skip(NO_SHAKESPEARE)
    return Path(shutil.copy(CORPUS, tmp_path / "tinyshakespeare.txt"))


@pytest.fixture
def gpt2() -> GPT2Tokenizer:
    use_gpt2_bpe()  # the shared offline cache, or a skip that says why
    return GPT2Tokenizer()


# --- shakespeare_char and shakespeare ----------------------------------------------------------


def test_char_prepare_round_trips(tmp_path):
    text = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer\n" * 3
    (tmp_path / "in.txt").write_text(text)
    meta = load_script("shakespeare_char").main([f"--input={tmp_path / 'in.txt'}", f"--out_dir={tmp_path / 'out'}"])
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
    assert meta["itos"] == sorted(set(text)) and meta["vocab_size"] == len(set(text)) + 1  # then <|endoftext|>
    assert meta["special_tokens"] == {"<|endoftext|>": len(set(text))}
    tok = CharTokenizer(meta["itos"])
    train, val = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "val")
    n = int(len(text) * 0.9)
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"]) == (n, len(text) - n)
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text


def test_char_prepare_full_shakespeare(tmp_path, corpus):
    meta = load_script("shakespeare_char").main([f"--input={corpus}", f"--out_dir={tmp_path}"])
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (66, 1_003_854, 111_540)  # 65 + eot
    assert TokenData(tmp_path, "val", block_size=256, vocab_size=66).num_tokens == 111_540


def test_bpe_prepare_matches_tiktoken(tmp_path, corpus, gpt2):
    meta = load_script("shakespeare").main([f"--input={corpus}", f"--out_dir={tmp_path}"])
    text = corpus.read_text()
    n = int(len(text) * 0.9)
    # GPT-2's ids for "First Citizen:\nBefore we proceed any further, hear me", as published vocabularies give them.
    assert read_split(tmp_path, "train")[:12].tolist() == [5962, 22307, 25, 198, 8421, 356, 5120, 597, 2252, 11,
                                                          3285, 502]
    assert read_split(tmp_path, "train").tolist() == gpt2.enc.encode_ordinary(text[:n])
    assert read_split(tmp_path, "val").tolist() == gpt2.enc.encode_ordinary(text[n:])
    assert (meta["train_tokens"], meta["val_tokens"]) == (301_966, 36_059)
    assert {k: meta[k] for k in ("tokenizer", "vocab_size", "eot_token")} == gpt2.meta()


def test_bpe_prepare_small_input(tmp_path, gpt2):
    text = "Hello, world! Ünïcödé too.\n" * 40
    (tmp_path / "in.txt").write_text(text)
    meta = load_script("shakespeare").main([f"--input={tmp_path / 'in.txt'}", f"--out_dir={tmp_path}"])
    # The line's GPT-2 ids, written out (not recomputed with the call prepare.py makes): "Hello" "," " world"
    # "!", " Ü" split into byte pieces, ..., "\n". The 90% split falls after line 36 of 40.
    line = [15496, 11, 995, 0, 49363, 77, 26884, 66, 9101, 67, 2634, 1165, 13, 198]
    assert (read_split(tmp_path, "train").tolist(), read_split(tmp_path, "val").tolist()) == (line * 36, line * 4)
    assert (meta["train_tokens"], meta["val_tokens"]) == (14 * 36, 14 * 4)


def test_input_txt_beside_the_output_is_used(tmp_path, monkeypatch):
    (tmp_path / "input.txt").write_text("abcabcabcabc")
    monkeypatch.setattr(core.data.corpus.urllib.request, "urlopen", lambda *a, **k: pytest.fail("must not download"))
    meta = load_script("shakespeare_char").main([f"--out_dir={tmp_path}"])
    assert meta["itos"] == ["a", "b", "c"]


def test_download_is_saved_beside_the_output(tmp_path, monkeypatch):
    monkeypatch.setattr(core.data.corpus.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"downloaded text"))
    meta = load_script("shakespeare_char").main([f"--out_dir={tmp_path}"])
    assert (tmp_path / "input.txt").read_text() == "downloaded text"
    assert meta["vocab_size"] == len(set("downloaded text")) + 1  # the characters, then <|endoftext|>


def test_no_network_says_how_to_pass_a_local_file(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(core.data.corpus.urllib.request, "urlopen", offline)
    with pytest.raises(UserError, match=r"could not download .*name resolution.*--input=path/to/input.txt"):
        load_script("shakespeare_char").main([f"--out_dir={tmp_path}"])
    assert list(tmp_path.iterdir()) == []


# --- openwebtext and fineweb, through the real datasets path ----------------------------------


def write_parquet(path: Path, docs: list[str], column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: docs, "url": [f"u{i}" for i in range(len(docs))]}), path)
    return path


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def web_documents(out_dir: Path, split: str, eot: int, dtype=np.uint16) -> list[list[int]]:
    """The split's ids cut after each <|endoftext|> (which ends every document), in shard order."""
    ids = read_split(out_dir, split, dtype).tolist()
    assert ids[-1] == eot
    cuts = [0] + [i + 1 for i, t in enumerate(ids) if t == eot]
    return [ids[a:b - 1] for a, b in zip(cuts, cuts[1:])]


def check_web_output(out_dir: Path, docs: list[str], tok, meta: dict) -> None:
    expected = sum(len(tok.encode(d)) + 1 for d in docs)  # one <|endoftext|> per document
    train, val = web_documents(out_dir, "train", tok.eot_token), web_documents(out_dir, "val", tok.eot_token)
    assert meta["train_tokens"] + meta["val_tokens"] == sum(map(len, train + val)) + len(train + val) == expected
    assert (meta["train_documents"], meta["val_documents"]) == (len(train), len(val)) and len(val) >= 1
    assert sorted(tok.decode(d) for d in train + val) == sorted(docs)  # every document, whole, once
    assert all(tok.encode(tok.decode(d)) == d for d in train + val)
    assert json.loads((out_dir / "meta.json").read_text()) == meta and meta["dtype"] == "uint16"
    assert {k: meta[k] for k in tok.meta()} == tok.meta()


def test_openwebtext_from_parquet(tmp_path, gpt2):
    docs = DOCS * 4
    src = write_parquet(tmp_path / "owt.parquet", docs)
    out = tmp_path / "out"
    meta = load_script("openwebtext").main([
        f"--data_files={src}", f"--out_dir={out}", f"--cache_dir={tmp_path / 'hf'}",
        "--num_proc=2", "--val_fraction=0.2", "--shard_tokens=25"])
    check_web_output(out, docs, gpt2, meta)
    assert len(list(out.glob("train_*.bin"))) > 1  # sharded
    assert TokenData(out, "train", block_size=4, vocab_size=50257).num_tokens == meta["train_tokens"]


def test_fineweb_from_jsonl(tmp_path, gpt2):
    docs = DOCS * 3
    src = write_jsonl(tmp_path / "fw.jsonl", docs)
    meta = load_script("fineweb").main([
        f"--data_files={src}", f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'hf'}",
        "--num_proc=1", "--val_fraction=0.1"])
    check_web_output(tmp_path / "out", docs, gpt2, meta)


def test_text_files_are_one_document_each(tmp_path, gpt2):
    for i, d in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt").write_text(d)
    meta = load_script("openwebtext").main([
        f"--data_files={tmp_path / 'doc*.txt'}", f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'hf'}",
        "--num_proc=1", "--val_fraction=0.2"])
    check_web_output(tmp_path / "out", DOCS, gpt2, meta)


def test_web_corpus_trains_its_bpe_on_the_train_split_streamed(tmp_path, gpt2, monkeypatch):
    """--tokenizer=bpe:VOCAB on a web corpus: trained on the train split's documents only, read as a generator
    (never the whole column in memory), stored in meta.json and tokenizer.json; the datasets cache of an
    earlier GPT-2 prepare of the same files is not reused for the new tokenizer's ids."""
    docs = [f"{d} {i} unique-{i}-words" for i, d in enumerate(DOCS * 6)]
    src = write_parquet(tmp_path / "owt.parquet", docs)
    args = [f"--data_files={src}", f"--cache_dir={tmp_path / 'hf'}", "--num_proc=2", "--val_fraction=0.25",
            "--shard_tokens=40"]
    load_script("openwebtext").main([*args, f"--out_dir={tmp_path / 'gpt2'}"])
    seen = []

    def recording_train_bpe(texts, *a, **k):
        seen.append(inspect.isgenerator(texts))
        return train_bpe(texts, *a, **k)

    monkeypatch.setattr(core.data.corpus, "train_bpe", recording_train_bpe)
    out = tmp_path / "bpe"
    meta = load_script("openwebtext").main([*args, f"--out_dir={out}", "--tokenizer=bpe:300"])
    assert seen == [True]
    tok = tokenizer_from_meta(meta)
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 300 and tok.decode([tok.eot_token]) == EOT
    assert (out / "tokenizer.json").read_text(encoding="utf-8") == meta["tokenizer_json"]
    check_web_output(out, docs, tok, meta)
    train = [tok.decode(d) for d in web_documents(out, "train", tok.eot_token)]
    again = train_bpe(iter(train), 300, core.data.corpus.BPE_RESERVED, progress=False)
    assert again.json == meta["tokenizer_json"]  # the train documents, in the order they were written, and no more
    assert TokenData(out, "train", block_size=4, vocab_size=300).num_tokens == meta["train_tokens"]


def write_tokenizer_json(path: Path, n_words: int, template: str | None = None) -> Path:
    """A word-level tokenizers JSON of <s>, </s>, w2, w3, ... (n_words ids); `template` its post-processor."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, n_words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    if template:
        backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0), ("</s>", 1)])
    backend.save(str(path))
    return path


def test_web_corpus_with_a_folders_tokenizer_gets_its_affixes(tmp_path):
    """--tokenizer=DIR on a web corpus: each document framed as the folder's post-processor frames a text
    (here <s> ... </s>), nothing else between them; tokenizer.json beside meta.json."""
    folder = tmp_path / "folder"
    folder.mkdir()
    write_tokenizer_json(folder / "tokenizer.json", 10, "<s> $A </s>")
    docs = ["w2 w3", "w4", "w5 w6 w7", "w8 w9 w9", "w3 w3"]
    src = write_jsonl(tmp_path / "fw.jsonl", docs)
    meta = load_script("fineweb").main([f"--data_files={src}", f"--out_dir={tmp_path / 'out'}", f"--tokenizer={folder}",
                                        f"--cache_dir={tmp_path / 'hf'}", "--num_proc=1", "--val_fraction=0.2"])
    assert (meta["tokenizer"], meta["vocab_size"], meta["train_documents"], meta["val_documents"]) == ("hf", 10, 4, 1)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    ids = read_split(tmp_path / "out", "train").tolist() + read_split(tmp_path / "out", "val").tolist()
    framed = " ".join(map(str, ids)).replace("1 0", "1 | 0").split(" | ")
    assert sorted(framed) == sorted("0 " + " ".join(d.replace("w", "").split()) + " 1" for d in docs)


def test_web_corpus_past_65536_ids_writes_uint32(tmp_path):
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json", 70_000, "$A </s>")
    docs = ["w69999 w65536", "w2", "w66000 w3", "w4"]
    meta = load_script("openwebtext").main([f"--data_files={write_jsonl(tmp_path / 'a.jsonl', docs)}",
                                            f"--out_dir={tmp_path / 'out'}", f"--tokenizer={tokenizer}",
                                            f"--cache_dir={tmp_path / 'hf'}", "--num_proc=1", "--val_fraction=0.25",
                                            "--shard_tokens=3"])
    assert meta["dtype"] == "uint32" and len(list((tmp_path / "out").glob("train_*.bin"))) > 1
    ids = np.concatenate([read_split(tmp_path / "out", s, np.uint32) for s in ("train", "val")]).tolist()
    assert sorted(ids) == sorted([69999, 65536, 1, 2, 1, 66000, 3, 1, 4, 1])
    assert TokenData(tmp_path / "out", "train", 1, 70_000).dtype == np.uint32


def test_web_source_without_text_column(tmp_path):
    src = write_parquet(tmp_path / "x.parquet", DOCS, column="content")
    with pytest.raises(UserError, match=r"has columns \['content', 'url'\], but no 'text' column"):
        load_script("openwebtext").main([f"--data_files={src}", f"--out_dir={tmp_path / 'out'}", "--tokenizer=bpe:300",
                                         f"--cache_dir={tmp_path / 'hf'}"])


def test_web_data_files_must_be_one_known_kind(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", DOCS)
    b = write_jsonl(tmp_path / "b.jsonl", DOCS)
    with pytest.raises(UserError, match="must all be one kind"):
        load_script("openwebtext").main([f"--data_files={a},{b}", f"--out_dir={tmp_path}", "--tokenizer=bpe:300"])


def test_fineweb_edu_flag_selects_the_hub_dataset():
    fineweb = load_script("fineweb")
    assert fineweb.hub_source(fineweb.FineWebConfig()) == ("HuggingFaceFW/fineweb", "sample-10BT")
    assert fineweb.hub_source(fineweb.FineWebConfig(edu=True)) == ("HuggingFaceFW/fineweb-edu", "sample-10BT")
    assert load_script("openwebtext").OpenWebTextConfig().dataset == "Skylion007/openwebtext"


# --- command line: bad input is one line on stderr and exit status 2 --------------------------


CLI_ERRORS = [
    ("shakespeare_char", ["--input=missing.txt"], "error: --input file 'missing.txt' not found"),
    ("shakespeare", ["--input=missing.txt"], "error: --input file 'missing.txt' not found"),
    ("openwebtext", ["--data_files=missing.parquet", "--tokenizer=bpe:300"],  # a BPE trained later: no GPT-2 file needed
     "error: --data_files: no file matches 'missing.parquet'"),
    ("fineweb", ["--num_proc=many"], "error: config key 'num_proc' expects int, got 'many' (command line)"),
    ("fineweb", ["--val_fraction=2"], "error: val_fraction must be between 0 and 1, got 2.0"),
    ("openwebtext", ["--data_files=missing.parquet", "--tokenizer=bpe:200"],
     "error: a byte-level BPE needs at least 261 ids (the 256 bytes and 5 special tokens), got bpe:200; "
     "pass a larger vocabulary"),
    ("fineweb", ["--tokenizer=char"], "error: --tokenizer=char is for data/text/prepare.py; this corpus takes gpt2, "
                                      "bpe:VOCAB, a transformers folder or a tokenizer.json"),
    ("fineweb", ["--tokenizer=no/such/folder"], "error: --tokenizer=no/such/folder: expected gpt2, bpe:VOCAB, "
                                                "a transformers folder or a tokenizer.json; no such file or folder"),
    ("shakespeare_char", ["--inputt=x"], "error: unknown config key 'inputt' (command line); did you mean 'input'?"),
]


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    results = run_scripts(*[[f"data/{script}/prepare.py", *args, f"--out_dir={tmp_path}"]
                            for script, args, _ in CLI_ERRORS])
    for (_, _, message), result in zip(CLI_ERRORS, results):
        assert_user_error(result, message)
        assert result.stderr.strip() == message  # the only line
    assert list(tmp_path.iterdir()) == []
