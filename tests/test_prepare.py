"""The data/<name>/prepare.py scripts, run on small local input in temporary folders.

    python -m pytest tests/test_prepare.py

Tiny Shakespeare comes from ../shared/data (copied into a temp folder) and GPT-2's BPE from
../shared/tiktoken_cache (tests.helpers.use_gpt2_bpe); tests that need them are skipped, saying
why, where they are absent.
"""
import importlib.util
import io
import json
import shutil
import urllib.error
from pathlib import Path

import numpy as np
import pytest

import core.prepare
from core.data import TokenData
from core.errors import UserError
from core.tokenizer import GPT2_EOT, CharTokenizer, GPT2Tokenizer
from tests.helpers import assert_user_error, run_scripts, use_gpt2_bpe

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

DOCS = ["First document.", "Zweites Dokument: ünïcödé ✓", "", "line one\nline two\n\n", "  spaces  ", "end"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", ROOT / "data" / name / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_split(out_dir: Path, split: str) -> np.ndarray:
    files = sorted(out_dir.glob(f"{split}.bin")) or sorted(out_dir.glob(f"{split}_*.bin"))
    return np.concatenate([np.fromfile(f, dtype=np.uint16) for f in files])


@pytest.fixture
def corpus(tmp_path) -> Path:
    if not CORPUS.is_file():
        pytest.skip(f"tiny Shakespeare not found at {CORPUS}")
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
    assert meta["itos"] == sorted(set(text)) and meta["vocab_size"] == len(set(text))
    tok = CharTokenizer(meta["itos"])
    train, val = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "val")
    n = int(len(text) * 0.9)
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"]) == (n, len(text) - n)
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text


def test_char_prepare_full_shakespeare(tmp_path, corpus):
    meta = load_script("shakespeare_char").main([f"--input={corpus}", f"--out_dir={tmp_path}"])
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1_003_854, 111_540)
    assert TokenData(tmp_path, "val", block_size=256, vocab_size=65).num_tokens == 111_540


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
    monkeypatch.setattr(core.prepare.urllib.request, "urlopen", lambda *a, **k: pytest.fail("must not download"))
    meta = load_script("shakespeare_char").main([f"--out_dir={tmp_path}"])
    assert meta["itos"] == ["a", "b", "c"]


def test_download_is_saved_beside_the_output(tmp_path, monkeypatch):
    monkeypatch.setattr(core.prepare.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"downloaded text"))
    meta = load_script("shakespeare_char").main([f"--out_dir={tmp_path}"])
    assert (tmp_path / "input.txt").read_text() == "downloaded text"
    assert meta["vocab_size"] == len(set("downloaded text"))


def test_no_network_says_how_to_pass_a_local_file(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(core.prepare.urllib.request, "urlopen", offline)
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


def check_web_output(out_dir: Path, docs: list[str], gpt2: GPT2Tokenizer, meta: dict) -> None:
    expected = sum(len(gpt2.encode(d)) + 1 for d in docs)  # one <|endoftext|> per document
    train, val = read_split(out_dir, "train"), read_split(out_dir, "val")
    assert meta["train_tokens"] + meta["val_tokens"] == len(train) + len(val) == expected
    assert meta["train_documents"] + meta["val_documents"] == len(docs) and meta["val_documents"] >= 1
    assert (train[-1], val[-1]) == (GPT2_EOT, GPT2_EOT)
    ids = np.concatenate([train, val]).tolist()
    found, doc = [], []
    for i in ids:
        if i == GPT2_EOT:
            found.append(gpt2.decode(doc))
            doc = []
        else:
            doc.append(i)
    assert sorted(found) == sorted(docs)  # every document, whole, once
    assert {k: meta[k] for k in ("tokenizer", "vocab_size", "eot_token")} == gpt2.meta()


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


def test_web_source_without_text_column(tmp_path):
    src = write_parquet(tmp_path / "x.parquet", DOCS, column="content")
    with pytest.raises(UserError, match=r"has columns \['content', 'url'\], but no 'text' column"):
        load_script("openwebtext").main([f"--data_files={src}", f"--out_dir={tmp_path / 'out'}",
                                         f"--cache_dir={tmp_path / 'hf'}"])


def test_web_data_files_must_be_one_known_kind(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", DOCS)
    b = write_jsonl(tmp_path / "b.jsonl", DOCS)
    with pytest.raises(UserError, match="must all be one kind"):
        load_script("openwebtext").main([f"--data_files={a},{b}", f"--out_dir={tmp_path}"])


def test_fineweb_edu_flag_selects_the_hub_dataset():
    fineweb = load_script("fineweb")
    assert fineweb.hub_source(fineweb.FineWebConfig()) == ("HuggingFaceFW/fineweb", "sample-10BT")
    assert fineweb.hub_source(fineweb.FineWebConfig(edu=True)) == ("HuggingFaceFW/fineweb-edu", "sample-10BT")
    assert load_script("openwebtext").OpenWebTextConfig().dataset == "Skylion007/openwebtext"


# --- command line: bad input is one line on stderr and exit status 2 --------------------------


CLI_ERRORS = [
    ("shakespeare_char", ["--input=missing.txt"], "error: --input file 'missing.txt' not found"),
    ("shakespeare", ["--input=missing.txt"], "error: --input file 'missing.txt' not found"),
    ("openwebtext", ["--data_files=missing.parquet"], "error: --data_files: no file matches 'missing.parquet'"),
    ("fineweb", ["--num_proc=many"], "error: config key 'num_proc' expects int, got 'many' (command line)"),
    ("fineweb", ["--val_fraction=2"], "error: val_fraction must be between 0 and 1, got 2.0"),
    ("shakespeare_char", ["--inputt=x"], "error: unknown config key 'inputt' (command line); did you mean 'input'?"),
]


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    results = run_scripts(*[[f"data/{script}/prepare.py", *args, f"--out_dir={tmp_path}"]
                            for script, args, _ in CLI_ERRORS])
    for (_, _, message), result in zip(CLI_ERRORS, results):
        assert_user_error(result, message)
        assert result.stderr.strip() == message  # the only line
    assert list(tmp_path.iterdir()) == []
