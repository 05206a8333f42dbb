"""bench.py runs end to end at tiny sizes and reports every section; speed itself is never asserted.

    python -m pytest tests/test_bench.py
"""
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bench
from benchmarks import attention, common, decode, train
from core import cpu, runtime
from core.errors import UserError
from model import GPT, GPTConfig
from tests.helpers import REPO_ROOT, cli_args, one_thread, use_gpt2_bpe

TINY = dict(
    device="cpu", dtype="float32", warmup=1, repeats=1,
    batch_size=2, block_size=16, n_layer=1, n_head=2, n_embd=32, vocab_size=64,
    attn_lengths="16,32,64", attn_n_head=2, attn_head_size=8,
    decode_n_layer=1, decode_n_head=2, decode_n_embd=32, decode_block_size=16, decode_vocab_size=64,
    decode_contexts="4,16", gen_prompt_len=4, gen_new_tokens=20,  # 20 > 16 - 4: the window slides
    bound_models="quickstart", bound_steps=1,  # the step against the bandwidth bound: the 4 x 128 model only
    fixed_rounds=1, fixed_steps=1,
)


def tiny_argv(tmp_path, **overrides) -> list[str]:
    return cli_args(TINY | {"out": str(tmp_path / "bench.json")} | overrides)


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
    attention_memory = result["attention"]  # the naive reference forms the scores; the fused kernel does not
    assert "aten::_scaled_dot_product" in attention_memory["sdpa_kernel"]
    assert attention_memory["rows"][-1]["naive_over_sdpa"] > 1
    assert [r["context"] for r in result["decode"]["rows"]] == [4, 16]
    parts = result["decode"]["generation"]["parts"]
    assert {name: p["tokens"] for name, p in parts.items()} == {"inside_context": 13, "past_context": 7, "all": 20}
    assert result["decode"]["generation"]["window_shift"] == 8  # sample.py's default: block_size // 2
    bound_dtypes = ["float32"] + ["bfloat16"] * cpu.cpu_native_bf16()
    assert [(r["model"].split(" (")[0], r["dtype"]) for r in result["decode"]["bound"]["rows"]] == \
        [("quick start", dtype) for dtype in bound_dtypes]
    fixed = result["decode"]["fixed"]
    assert [(r["precision"], r["threads"], r["batch"]) for r in fixed["rows"]] == [("float32", 1, 1), ("int8", 1, 1)]
    assert all({"eager_cpu_ms", "fixed_cpu_ms"} <= set(r) and "compiled_ms" not in r for r in fixed["rows"])
    assert fixed["context"] == 8  # decode_block_size // 2
    for heading in ("Training step", "Attention memory", "Decoding", "Decoding against the bandwidth bound",
                    "The fixed-shape decode step against the eager one"):
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
        monkeypatch.setattr(common, "DEFAULT_CORPUS", str(tmp_path / "absent.txt"))
        monkeypatch.setattr(common, "GENERATED_CHARS", 5000)
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
    assert compiled == {"mode": "compiled", "batch_size": 2, "error": "compile failed: RuntimeError: no C++ compiler"}
    assert "compiled_over_eager" not in result["train"]
    assert "compile failed: RuntimeError: no C++ compiler" in capsys.readouterr().out


def test_cpu_memory_measure_sees_exact_allocations():
    def one_after_another():
        torch.empty(2**18)  # 2^18 float32 = 1 MiB, freed at once
        torch.empty(2**18)

    kept = []
    peaks = common.cpu_peak_extra_bytes({
        "two at once": lambda: (torch.empty(2**18), torch.empty(2**18)),
        "one after another": one_after_another,
        "kept": lambda: kept.append(torch.empty(2**18)),  # still held after its window: does not shift later ones
        "one": lambda: torch.empty(2**18),
    })
    assert peaks == {"two at once": 2**21, "one after another": 2**20, "kept": 2**20, "one": 2**20}


class FakeClock:
    """time.perf_counter for benchmarks.common: returns the scripted readings in order."""

    def __init__(self, readings):
        self.readings = iter(readings)

    def __call__(self):
        return next(self.readings)


def test_median_time_runs_warmup_then_times_each_repeat(monkeypatch):
    """Three timed runs of 5, 1 and 6 s (scripted clock) after two untimed ones: the median is 5 (the mean
    would be 4, the minimum 1); synchronize runs after the warm-up and after each timed call."""
    events = []
    monkeypatch.setattr(common.time, "perf_counter", FakeClock([0, 5, 10, 11, 20, 26]))
    seconds = common.median_time(lambda: events.append("call"), warmup=2, repeats=3,
                                synchronize=lambda: events.append("sync"))
    assert seconds == 5
    assert events == ["call", "call", "sync", "call", "sync", "call", "sync", "call", "sync"]


def scripted(values):
    """A stand-in for common.median_time returning the given seconds, one per call, in order."""
    values = iter(values)
    return lambda *args, **kwargs: next(values)


def test_train_rows_tokens_mfu_and_compile_ratio(tmp_path, monkeypatch):
    """Step times 0.5 s (eager) and 0.2 s (compiled), a 1 TFLOP/s peak: the figures follow by arithmetic."""
    monkeypatch.setattr(train, "median_time", scripted([0.5, 0.2]))
    monkeypatch.setattr(train.runtime, "peak_flops_with_source", lambda rt: (1e12, "a 1 TFLOP/s test peak"))
    monkeypatch.setattr(train.torch, "compile", lambda model: model)  # the compiled row, without a compiler
    cfg = bench.load_config(tiny_argv(tmp_path, compile=True))
    with one_thread():
        result = train.measure(cfg, runtime.setup("cpu", "float32"))
    eager, compiled = result["rows"]
    # 1 layer, 32 wide, vocab 64, no biases: wte + 12 C^2 + three LayerNorm gains (wpe left out).
    n = 64 * 32 + 12 * 32 * 32 + 3 * 32
    assert result["params"] == n == 14_432
    flops_per_token = 6 * n + 12 * 1 * 2 * 16 * 16  # 6N + 12 * layers * heads * head size * block
    assert result["flops_per_token"] == flops_per_token and result["tokens_per_step"] == 32
    assert eager["step_s"] == 0.5 and eager["tokens_per_s"] == 64.0
    assert eager["mfu"] == pytest.approx(flops_per_token * 32 / 0.5 / 1e12, rel=1e-12)
    assert compiled["step_s"] == 0.2 and compiled["tokens_per_s"] == pytest.approx(160.0)
    assert result["compiled_over_eager"] == pytest.approx(2.5)


def test_the_micro_batch_sweep_has_a_row_per_size_and_mode_and_oom_is_a_row(tmp_path, monkeypatch, capsys):
    """train_batch_sizes: each size eager then compiled, tokens/s and MFU of its own batch; a size that runs out of
    device memory (faked: the step at 4 rows raises torch's OutOfMemoryError) reads OOM, and the sweep goes on."""
    times = scripted([0.5, 0.25, 1.0, 0.5])
    monkeypatch.setattr(train, "median_time", lambda fn, *a: fn() or times())
    monkeypatch.setattr(train.runtime, "peak_flops_with_source", lambda rt: (1e12, "a 1 TFLOP/s test peak"))
    monkeypatch.setattr(train.torch, "compile", lambda model: model)
    real_forward = GPT.forward

    def forward(self, idx, *args, **kwargs):
        if idx.size(0) == 4:
            raise torch.OutOfMemoryError("CUDA out of memory (faked)")
        return real_forward(self, idx, *args, **kwargs)
    monkeypatch.setattr(GPT, "forward", forward)
    with one_thread():
        result = bench.main(tiny_argv(tmp_path, sections="train", compile=True, train_batch_sizes="2,4,8"))
    rows = [(r["mode"], r["batch_size"], r.get("tokens_per_s", r.get("error"))) for r in result["train"]["rows"]]
    assert rows == [("eager", 2, 64.0), ("compiled", 2, 128.0), ("eager", 4, "OOM"), ("compiled", 4, "OOM"),
                    ("eager", 8, 128.0), ("compiled", 8, 256.0)]
    assert result["train"]["rows"][4]["mfu"] == pytest.approx(result["train"]["flops_per_token"] * 128 / 1e12)
    assert re.search(r"\|\s*eager\s*\|\s*4\s*\|.*OOM", capsys.readouterr().out)


def test_attention_memory_medians_ratios_and_growth(monkeypatch):
    """Scripted peaks (three repeats each, the middle one the median): naive 4 T^2 * (1, 3, 2) bytes, sdpa
    100 T * (2, 1, 3). Each row holds the medians, naive_over_sdpa their ratio, and the growth exponents
    between T = 16 and 64 are 2 and 1."""
    scale = {"naive": (1, 3, 2), "sdpa": (2, 1, 3)}

    def fake_peaks(runs):
        out = {}
        for name in runs:  # e.g. "naive_forward_backward_bytes T=32 #1"
            key, T, rep = name.split(" ")
            T, rep = int(T[2:]), int(rep[1:])
            kind = key.split("_")[0]
            out[name] = (4 * T * T if kind == "naive" else 100 * T) * scale[kind][rep]
        return out

    monkeypatch.setattr(common, "cpu_peak_extra_bytes", fake_peaks)
    cfg = bench.load_config(["--device=cpu", "--dtype=float32", "--attn_lengths=16,32,64", "--attn_repeats=3",
                             "--attn_n_head=2", "--attn_head_size=8"])
    with one_thread():
        result = attention.measure(cfg, runtime.setup("cpu", "float32"))
    for row in result["rows"]:
        T = row["T"]
        assert row["naive_forward_bytes"] == row["naive_forward_backward_bytes"] == 2 * 4 * T * T
        assert row["sdpa_forward_bytes"] == row["sdpa_forward_backward_bytes"] == 2 * 100 * T
        assert row["naive_over_sdpa"] == pytest.approx(4 * T / 100)
        assert row["score_matrix_bytes"] == 1 * 2 * T * T * 4
    growth = result["growth_exponent"]
    assert growth["naive_forward_backward_bytes"] == pytest.approx(2.0)
    assert growth["sdpa_forward_bytes"] == pytest.approx(1.0)


def test_decode_speedups_and_generation_medians(monkeypatch):
    """Scripted times: per context, no cache 4 ms and cache 1 ms at C=4, 8 ms and 2 ms at C=16. Generation:
    three runs per mode, each token 0.1 s (cache) or 0.3 s (no cache) times the run's factor (1, 5, 2),
    so each part's median is the factor-2 run."""
    monkeypatch.setattr(decode, "median_time", scripted([0.004, 0.001, 0.008, 0.002]))
    factors = iter([1, 1, 1, 5, 2, 1, 5, 2])  # the two warm-up calls, then no_cache x 3, cache x 3

    def fake_token_times(model, prompt, new_tokens, use_cache, shift, rt, steps=None):
        return [(0.1 if use_cache else 0.3) * next(factors)] * new_tokens

    monkeypatch.setattr(decode, "token_times", fake_token_times)
    cfg = bench.load_config(tiny_argv(Path("."), gen_repeats=3, decode_batch_size=2))
    with one_thread():
        result = decode.measure(cfg, runtime.setup("cpu", "float32"))
    rows = {r["context"]: r for r in result["rows"]}
    assert rows[4]["no_cache_ms"] == pytest.approx(4.0) and rows[4]["cache_ms"] == pytest.approx(1.0)
    assert rows[4]["speedup"] == pytest.approx(4.0) and rows[16]["speedup"] == pytest.approx(4.0)
    assert rows[16]["cache_tokens_per_s"] == pytest.approx(2 / 0.002)  # batch of 2 tokens per step
    parts = result["generation"]["parts"]  # 13 tokens inside the context, 7 past it
    assert parts["inside_context"]["no_cache_s"] == pytest.approx(13 * 0.3 * 2)
    assert parts["past_context"]["cache_s"] == pytest.approx(7 * 0.1 * 2)
    assert parts["all"]["speedup"] == pytest.approx(3.0)
    assert parts["all"]["cache_tokens_per_s"] == pytest.approx(20 * 2 / (20 * 0.1 * 2))


def test_the_fixed_step_table_gives_each_way_against_eager_and_a_failed_compile_as_its_row():
    from benchmarks import fixed_step
    rows = [{"precision": "float32", "threads": 1, "batch": 1, "eager_ms": 9, "eager_cpu_ms": 4.0, "fixed_ms": 9,
             "fixed_cpu_ms": 5.0, "compiled_ms": 9, "compiled_cpu_ms": 3.0, "compiled_first3_s": 40.0},
            {"precision": "int8", "threads": 2, "batch": 4, "eager_ms": 9, "eager_cpu_ms": 2.0, "fixed_ms": 9,
             "fixed_cpu_ms": 1.0, "compiled_error": "Unsupported: packed weights"}]
    text = fixed_step.table({"context": 512, "rounds": 3, "steps": 10, "device": "cpu", "rows": rows})
    assert re.search(r"\|\s*float32\s*\|\s*1\s*\|\s*1\s*\|\s*4.000\s*\|\s*5.000\s*\|\s*3.000\s*\|\s*1.25x\s*\|"
                     r"\s*0.75x\s*\|\s*40.0\s*\|", text)
    assert re.search(r"\|\s*int8\s*\|.*\|\s*Unsupported: packed weights\s*\|\s*0.50x\s*\|\s*-\s*\|\s*-\s*\|", text)
    assert "eager CPU ms" in text


def test_the_fixed_step_runs_each_row_at_its_thread_count_and_restores_the_count(monkeypatch):
    """On a CPU one thread and the bench's count (here 3), each batch at both; the count comes back after."""
    from benchmarks import fixed_step
    seen = []

    def row(cfg, model, batch, context, rt) -> dict:
        seen.append(torch.get_num_threads())
        return {}
    monkeypatch.setattr(fixed_step, "row", row)
    monkeypatch.setattr(fixed_step.bandwidth, "decoding_model", lambda *args: None)
    cfg = bench.load_config(["--fixed_precisions=float32", "--fixed_batches=1,2"])
    with common.num_threads(3):
        rows = fixed_step.measure(cfg, GPTConfig(block_size=16), runtime.setup("cpu", "float32"))["rows"]
        assert torch.get_num_threads() == 3
    assert seen == [r["threads"] for r in rows] == [1, 1, 3, 3] and [r["batch"] for r in rows] == [1, 2, 1, 2]


def test_markdown_tables_pad_and_right_align_every_column():
    assert common.markdown_table(["a", "long header"], [[1, "x"], ["wide cell", 2.5]]).splitlines() == [
        "|         a | long header |",
        "|----------:|------------:|",
        "|         1 |           x |",
        "| wide cell |         2.5 |"]


def test_preset_fills_what_the_command_line_leaves():
    cfg = bench.load_config(["--preset=gpt2", "--batch_size=2"])
    assert (cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.vocab_size) == (2, 1024, 768, 50304)
    assert cfg.attn_lengths.endswith("16384")
    assert bench.load_config([]).block_size == 256


def test_the_default_run_leaves_out_the_sections_that_take_minutes():
    """`python bench.py` (docs/performance.md's whole run): every section but speedrun and peers, in run order."""
    assert bench.General().sections == "train,loop,attention,decode,prepare,memory,serve"


def test_the_docs_name_only_sections_that_exist():
    """Every `--sections=...` in the README, docs/ and bench.py's modules names a section of SECTIONS (the docs'
    command check sees that bench.py takes --sections, not what it names)."""
    files = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md"), REPO_ROOT / "bench.py",
             *(REPO_ROOT / "benchmarks").glob("*.py")]
    named = {name for f in files for spec in re.findall(r"--sections=([\w,]+)", f.read_text()) for name in spec.split(",")}
    assert {"speedrun", "peers", "decode"} <= named and named <= set(bench.SECTIONS), named - set(bench.SECTIONS)


@pytest.mark.parametrize("argv, fragment", [
    (["--preset=gpt3"], "unknown preset"),
    (["--sections=train,speed"], "speed"),
    (["--decode_contexts=64,512"], "decode_block_size"),
    (["--attn_lengths=256,x"], "attn_lengths"),
    (["--gen_window_shift=0"], "gen_window_shift"),
    (["--bound_models=quickstart,gpt3"], "bound_models: unknown gpt3"),
    (["--train_batch_sizes=8,x"], "train_batch_sizes"),
    (["--fixed_precisions=float32,int3"], "fixed_precisions: unknown int3"),
    (["--n_embd=100"], r"n_embd \(100\) must be divisible by n_head \(6\)"),
    (["--decode_n_head=7"], r"decode_n_embd \(384\) must be divisible by decode_n_head \(7\)"),
])
def test_bad_flags_are_user_errors(argv, fragment):
    with pytest.raises(UserError, match=fragment):
        bench.load_config(argv)


def test_generation_inside_the_context_has_one_row():
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    rt = runtime.setup("cpu", "float32")
    cfg = bench.load_config(["--gen_new_tokens=5", "--gen_repeats=2"])
    with one_thread():
        gen = decode.generation_times(cfg, model, torch.zeros(1, 4, dtype=torch.long), rt)
    assert list(gen["parts"]) == ["inside_context"] and gen["parts"]["inside_context"]["tokens"] == 5
    assert_positive_numbers(gen)


def test_thread_count_is_restored(tmp_path):
    before = torch.get_num_threads()
    bench.main(tiny_argv(tmp_path, sections="attention", attn_lengths="16", threads=before + 1))
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_serve_section_measures_the_server_against_in_process(tmp_path, capsys):
    """A real serve.py process streams every request (benchmarks.serve checks each one's usage), alternated
    with the same requests through an in-process BatchEngine (which must give each its tokens too)."""
    # 3 clients > 2 slots: one waits. 64 tokens a request, the default: the server's CPU seconds come from /proc in
    # clock ticks (10 ms), and on a fast CPU one client's 5 tokens took under one, so its CPU time read 0; and a
    # request fills the quick start's context, beside which the prefix cache's prompt must still fit
    result = bench.main(tiny_argv(tmp_path, sections="serve", serve_clients="1,3", serve_max_tokens=64,
                                  serve_prompt_len=4, serve_max_batch=2))
    serve = result["serve"]
    rows = serve["rows"]
    assert serve["shape"] == "quickstart" and serve["model"].startswith("4 layers x 128 wide")
    assert [(row["engine"], row["clients"]) for row in rows] == [("process", 1), ("process", 3), ("thread", 1),
                                                                 ("thread", 3)]
    assert [row["tokens"] for row in rows] == [64, 192, 64, 192]
    assert_positive_numbers(serve)
    for row in rows:
        for way in ("server", "in_process"):
            assert row[way]["tokens_per_s"] == pytest.approx(row["tokens"] / row[way]["s"])
            assert row[way]["ttft_p50_ms"] <= row[way]["ttft_p95_ms"] <= 1000 * row[way]["s"]
        assert row["time_ratio"] == pytest.approx(row["server"]["s"] / row["in_process"]["s"])
        assert row["cpu_ratio"] == pytest.approx(row["server"]["cpu_s"] / row["in_process"]["cpu_s"])
    assert rows[0]["vs_first"] == rows[2]["vs_first"] == 1
    assert serve["prefix"]["same_text"] and serve["prefix"]["cached_tokens"] > 0  # the second time, from the cache
    assert "### Serving" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench.json").read_text())["serve"]["rows"][1]["clients"] == 3


def test_serve_section_quantizes_both_sides_alike(tmp_path, capsys, monkeypatch):
    """--serve_quantize=int8: serve.py is started with --quantize=int8 and the in-process engine decodes the int8
    model (quantize.quantize on both: once here, once in the server's process)."""
    from benchmarks import serve as serve_section
    from core.decoding import quantize

    started, real_popen, real_quantize = [], serve_section.subprocess.Popen, quantize.quantize
    def popen(argv, **kw):  # serve.py's; platform's `uname -p` may come first
        started.extend([argv] if any(str(a).endswith("serve.py") for a in argv) else [])
        return real_popen(argv, **kw)
    monkeypatch.setattr(serve_section.subprocess, "Popen", popen)
    kinds = []
    monkeypatch.setattr(quantize, "quantize", lambda model, kind: kinds.append(kind) or real_quantize(model, kind))
    result = bench.main(tiny_argv(tmp_path, sections="serve", serve_clients="2", serve_max_tokens=8,
                                  serve_prompt_len=4, serve_max_batch=2, serve_engines="thread", serve_quantize="int8"))
    assert kinds == ["int8"] and result["serve"]["quantize"] == "int8"
    assert "--quantize=int8" in started[0]
    assert [row["tokens"] for row in result["serve"]["rows"]] == [16]
    assert "(quickstart, int8 weights)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--serve_shape=gpt3"], "serve_shape"),
    (["--sections=serve", "--serve_prompt_len=65"], "block_size 64"),
    (["--serve_clients=1,x"], "serve_clients"),
    (["--serve_engines=process,fork"], "serve_engines"),
    (["--serve_client=curl"], "serve_client"),
    (["--serve_quantize=int3"], "--quantize must be one of"),
])
def test_bad_serve_flags_are_user_errors(argv, fragment):
    with pytest.raises(UserError, match=fragment):
        bench.load_config(argv)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads processes from /proc (Linux)")
@pytest.mark.parametrize("reply, want", [
    # chunked: a line split across two chunks, two lines in one, a chunk extension
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n6;x=1\r\n 1\n\nda\r\n"
     b"7\r\nta: 2\n\n\r\n0\r\n\r\n", [(200, "data: 1"), (200, ""), (200, "data: 2"), (200, "")]),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{\"error\": 1}\n", [(400, '{"error": 1}')]),
])
def test_the_lean_client_reads_chunked_and_sized_replies(reply, want):
    from benchmarks.serve import lean_stream

    async def run():
        got_request = []

        async def answer(reader, writer):
            got_request.append(await reader.readuntil(b"\r\n\r\n") + await reader.readexactly(8))
            writer.write(reply)
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        lines = [x async for x in lean_stream(f"http://127.0.0.1:{port}", "/v1/x", {"a": 1})]
        server.close()
        return got_request[0], lines
    request, lines = asyncio.run(asyncio.wait_for(run(), 60))
    assert request.startswith(b"POST /v1/x HTTP/1.1\r\n") and request.endswith(b'\r\n\r\n{"a": 1}')
    assert lines == want


def test_a_servers_cpu_counts_its_engine_process(tmp_path):
    """The serve section's server CPU includes its children (serve.py's engine process): a parent that only
    sleeps, beside a child that burns a second, has used about a second."""
    from benchmarks.serve import process_cpu_s
    flag = tmp_path / "burnt"
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    t = time.process_time()\n"
            "    while time.process_time() - t < 1.0: pass\n"
            f"    open({str(flag)!r}, 'w').close(); time.sleep(60); os._exit(0)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_cpu_s(proc.pid) >= 0.9
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
