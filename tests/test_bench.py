"""bench.py runs end to end at tiny sizes and reports every section; speed itself is never asserted.

    python -m pytest tests/test_bench.py
"""
import json
import math
import re

import pytest
import torch

import bench
from core import runtime
from core.errors import UserError
from model import GPT, GPTConfig
from tests.helpers import one_thread, use_gpt2_bpe

TINY = dict(
    device="cpu", dtype="float32", warmup=1, repeats=1,
    batch_size=2, block_size=16, n_layer=1, n_head=2, n_embd=32, vocab_size=64,
    attn_lengths="16,32,64", attn_n_head=2, attn_head_size=8,
    decode_n_layer=1, decode_n_head=2, decode_n_embd=32, decode_block_size=16, decode_vocab_size=64,
    decode_contexts="4,16", gen_prompt_len=4, gen_new_tokens=20,  # 20 > 16 - 4: the window slides
)


def tiny_argv(tmp_path, **overrides) -> list[str]:
    cfg = TINY | {"out": str(tmp_path / "bench.json")} | overrides
    return [f"--{key}={value}" for key, value in cfg.items()]


def numbers(obj):
    """Every number in a JSON value (bools are not numbers here)."""
    if isinstance(obj, dict):
        for value in obj.values():
            yield from numbers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from numbers(value)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


def assert_positive_numbers(section: dict) -> None:
    values = list(numbers(section))
    assert values and all(math.isfinite(v) and v > 0 for v in values), section


def test_train_attention_decode_in_json_and_table(tmp_path, capsys):
    with one_thread():
        bench.main(tiny_argv(tmp_path, sections="train,attention,decode", compile=False))
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "bench.json").read_text())

    for key in ("cpu", "cpu_cores", "torch", "device_name", "date"):
        assert result["machine"][key], key
    for section in ("train", "attention", "decode"):
        assert_positive_numbers(result[section])
    assert "prepare" not in result
    assert [r["mode"] for r in result["train"]["rows"]] == ["eager"]
    assert [r["T"] for r in result["attention"]["rows"]] == [16, 32, 64]
    assert [r["context"] for r in result["decode"]["rows"]] == [4, 16]
    parts = result["decode"]["generation"]["parts"]
    assert {name: p["tokens"] for name, p in parts.items()} == {"inside_context": 13, "past_context": 7, "all": 20}
    assert result["decode"]["generation"]["window_shift"] == 8  # sample.py's default: block_size // 2
    for heading in ("Training step", "Attention memory", "Decoding"):
        assert f"### {heading}" in out
    assert re.search(r"\|\s*eager\s*\|", out)
    assert "Data preparation" not in out


@pytest.mark.parametrize("which", ["given", "generated"])
def test_prepare_on_a_given_or_generated_corpus(tmp_path, capsys, monkeypatch, which):
    use_gpt2_bpe()
    extra, text = {}, "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20
    if which == "given":
        extra["corpus"] = tmp_path / "corpus.txt"
        extra["corpus"].write_text(text)
    else:
        monkeypatch.setattr(bench, "DEFAULT_CORPUS", str(tmp_path / "absent.txt"))
        monkeypatch.setattr(bench, "GENERATED_CHARS", 5000)
    result = bench.main(tiny_argv(tmp_path, sections="prepare", **extra))
    assert_positive_numbers(result["prepare"])
    assert result["prepare"]["chars"] == (len(text) if which == "given" else 5000)
    expected = str(extra["corpus"]) if which == "given" else "generated text"
    assert result["prepare"]["corpus"].startswith(expected)
    assert "### Data preparation" in capsys.readouterr().out


def test_compile_failure_is_reported_not_raised(tmp_path, capsys, monkeypatch):
    def broken_compile(model, *args, **kwargs):
        raise RuntimeError("no C++ compiler\nsecond line")
    monkeypatch.setattr(torch, "compile", broken_compile)
    with one_thread():
        result = bench.main(tiny_argv(tmp_path, sections="train", compile=True))
    eager, compiled = result["train"]["rows"]
    assert compiled == {"mode": "compiled", "error": "compile failed: RuntimeError: no C++ compiler"}
    assert "compiled_over_eager" not in result["train"]
    assert "compile failed: RuntimeError: no C++ compiler" in capsys.readouterr().out


def test_cpu_memory_measure_sees_exact_allocations():
    def one_after_another():
        torch.empty(2**18)  # 2^18 float32 = 1 MiB, freed at once
        torch.empty(2**18)

    kept = []
    peaks = bench.cpu_peak_extra_bytes({
        "two at once": lambda: (torch.empty(2**18), torch.empty(2**18)),
        "one after another": one_after_another,
        "kept": lambda: kept.append(torch.empty(2**18)),  # still held after its window: does not shift later ones
        "one": lambda: torch.empty(2**18),
    })
    assert peaks == {"two at once": 2**21, "one after another": 2**20, "kept": 2**20, "one": 2**20}


def test_median_time_runs_warmup_then_repeats():
    calls = []
    seconds = bench.median_time(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and seconds >= 0


def test_preset_fills_what_the_command_line_leaves():
    cfg = bench.load_config(["--preset=gpt2", "--batch_size=2"])
    assert (cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.vocab_size) == (2, 1024, 768, 50304)
    assert cfg.attn_lengths.endswith("16384")
    assert bench.load_config([]).block_size == 256


@pytest.mark.parametrize("argv, fragment", [
    (["--preset=gpt3"], "unknown preset"),
    (["--sections=train,speed"], "speed"),
    (["--decode_contexts=64,512"], "decode_block_size"),
    (["--attn_lengths=256,x"], "attn_lengths"),
    (["--gen_window_shift=0"], "gen_window_shift"),
])
def test_bad_flags_are_user_errors(argv, fragment):
    with pytest.raises(UserError, match=fragment):
        bench.load_config(argv)


def test_generation_inside_the_context_has_one_row():
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    rt = runtime.setup("cpu", "float32")
    cfg = bench.load_config(["--gen_new_tokens=5", "--gen_repeats=2"])
    with one_thread():
        gen = bench.bench_generation(cfg, model, torch.zeros(1, 4, dtype=torch.long), rt)
    assert list(gen["parts"]) == ["inside_context"] and gen["parts"]["inside_context"]["tokens"] == 5
    assert_positive_numbers(gen)


def test_thread_count_is_restored(tmp_path):
    before = torch.get_num_threads()
    bench.main(tiny_argv(tmp_path, sections="attention", attn_lengths="16", threads=before + 1))
    assert torch.get_num_threads() == before
