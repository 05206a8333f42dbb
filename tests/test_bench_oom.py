"""bench.py when memory runs out, and its JSON written section by section; the loop section.

    python -m pytest tests/test_bench_oom.py

The allocation failure is faked where a big tensor is made (torch.softmax over the (T, T) scores,
F.scaled_dot_product_attention past a context length, F.cross_entropy over the logits): it raises
torch.OutOfMemoryError as CUDA's allocator would.
"""
import json
import statistics

import pytest
import torch
import torch.nn.functional as F

import bench
from benchmarks import common, decode
from core import runtime
from core.errors import UserError
from tests.helpers import one_thread
from tests.test_bench import tiny_argv


def raise_oom_when(real, too_big):
    def fake(*args, **kwargs):
        if too_big(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")
        return real(*args, **kwargs)
    return fake


def test_oom_is_reported_per_row_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "softmax", raise_oom_when(torch.softmax, lambda x, *a, **k: x.size(-1) >= 64))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        raise_oom_when(F.scaled_dot_product_attention,  # the decode model's heads (size 16) only
                                       lambda q, k, *a, **kw: k.size(-2) >= 16 and k.size(-1) == 16))
    monkeypatch.setattr(F, "cross_entropy", raise_oom_when(F.cross_entropy, lambda *a, **k: True))
    with one_thread():
        bench.main(tiny_argv(tmp_path, sections="train,attention,decode", compile=False))
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["train"]["rows"] == [{"mode": "eager", "batch_size": 2, "error": "OOM"}]
    rows = {row["T"]: row for row in result["attention"]["rows"]}
    assert rows[64]["naive_forward_bytes"] == rows[64]["naive_forward_backward_bytes"] == "OOM"
    assert rows[64]["naive_over_sdpa"] is None
    assert all(isinstance(rows[T][key], int) and rows[T][key] > 0 for T in (16, 32, 64)
               for key in ("sdpa_forward_bytes", "sdpa_forward_backward_bytes"))
    assert all(isinstance(rows[T]["naive_forward_bytes"], int) for T in (16, 32))
    assert set(result["attention"]["growth_exponent"]) >= {"sdpa_forward_bytes"}  # from the rows that fit
    by_context = {row["context"]: row for row in result["decode"]["rows"]}
    assert by_context[16] == {"context": 16, "error": "OOM"} and by_context[4]["cache_ms"] > 0
    assert result["decode"]["generation"] == {"error": "OOM"}  # it passes context 16
    assert out.count("OOM") >= 6  # the tables say it, row by row


def test_json_is_written_after_each_section(tmp_path, monkeypatch):
    """A failure in a later section keeps the figures of the earlier ones on disk."""
    def broken(cfg, rt):
        raise UserError("decode broke")
    monkeypatch.setattr(decode, "measure", broken)
    with one_thread(), pytest.raises(UserError, match="decode broke"):
        bench.main(tiny_argv(tmp_path, sections="train,attention,decode", compile=False))
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result) >= {"machine", "config", "train", "attention"} and "decode" not in result
    assert result["train"]["rows"][0]["step_s"] > 0


@pytest.mark.slow
def test_loop_section_compares_train_py_with_a_plain_loop(tmp_path, tmp_path_factory, capsys, monkeypatch):
    config = tmp_path / "tiny_loop.py"
    config.write_text("n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 16\nbatch_size = 2\n"
                      "gradient_accumulation_steps = 2\nlog_interval = 3\ndropout = 0.0\n")
    monkeypatch.setattr(common, "GENERATED_CHARS", 20_000)
    monkeypatch.setattr(common, "DEFAULT_CORPUS", str(tmp_path / "absent.txt"))
    with one_thread():
        bench.main(tiny_argv(tmp_path, sections="loop", loop_config=str(config), loop_steps=3, repeats=2))
    r = json.loads((tmp_path / "bench.json").read_text())["loop"]
    assert r["accum"] == 2 and r["plain_ms"] > 0 and r["train_py_ms"] > 0
    assert r["train_py_over_plain"] == pytest.approx(r["train_py_ms"] / r["plain_ms"])
    assert len(r["chunk_ms"]["plain"]) == len(r["chunk_ms"]["train_py"]) == len(r["chunk_ms"]["recipe"]) == 2
    # train.py itself ran each chunk: its log.jsonl timed 3 steps after the warm-up ones
    assert r["train_py_steps"] == [3, 3]
    # and train.py with config/modern.py after the config, Newton-Schulz at the precision this CPU computes
    pairs = [m / c for m, c in zip(r["chunk_ms"]["recipe"], r["chunk_ms"]["train_py"])]
    assert r["recipe_ms"] > 0 and r["recipe_over_train_py"] == pytest.approx(statistics.median(pairs))
    assert r["muon_newton_schulz"] == ("bfloat16" if runtime.native_bf16("cpu") else "float32")
    out = capsys.readouterr().out
    assert "train.py against a plain loop" in out and "| train.py + config/modern.py (Newton-Schulz in" in out
    assert f"config/modern.py / classic train.py: {r['recipe_over_train_py']:.2f}x" in out
