"""benchmarks/bandwidth.py: the bytes a cached decode step reads, its bound, and the copy that measures
the bandwidth (with a scripted clock: speed itself is never asserted).

    python -m pytest tests/test_bandwidth.py
"""
import re

import pytest
import torch

from benchmarks import bandwidth
from core import cpu, runtime
from core.cpu import PackedLinear
from core.decoding.decode import inference_model
from model import GPT, GPTConfig

TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=40, dropout=0.0)


def test_decode_reads_every_weight_but_the_looked_up_tables(monkeypatch):
    """Tied head (GPT-2): the token table is the head, read whole; the position table is one row. Untied:
    the token table is one row and the head whole. bf16 weights are half the bytes, packed or not."""
    tied = GPT(GPTConfig(**TINY))
    C, V = 16, 40
    blocks = sum(p.numel() for p in tied.transformer.h.parameters()) + sum(p.numel() for p in tied.transformer.ln_f.parameters())
    assert bandwidth.decode_weight_bytes(tied) == 4 * (blocks + V * C + C)  # + wte whole, + one wpe row
    untied = GPT(GPTConfig(**TINY, tie_embeddings=False, pos_embedding="rope"))
    blocks = sum(p.numel() for p in untied.transformer.h.parameters()) + sum(p.numel() for p in untied.transformer.ln_f.parameters())
    assert bandwidth.decode_weight_bytes(untied) == 4 * (blocks + V * C + C)  # + the head whole, + one wte row
    monkeypatch.setattr(cpu, "PACK_MIN_WEIGHTS", 0)  # pack every matrix, however small
    bf16 = inference_model(GPT(GPTConfig(**TINY)), runtime.Runtime("cpu", "cpu", "bfloat16"))[0]
    assert bandwidth.decode_weight_bytes(bf16) * 2 == bandwidth.decode_weight_bytes(tied)
    # where bf16 is native the Blocks' matrices are packed (cpu.pack_linears), and still counted
    assert any(isinstance(m, PackedLinear) for m in bf16.modules()) == cpu.cpu_packs_bf16()


def test_an_int8_step_reads_its_matrices_at_a_byte_each():
    """quantize.QuantizedLinear's weight_bytes: the Blocks' matrices and the head's quantized copy at one byte a weight
    and 4 bytes per output for the scale and the bias; the token table, no longer the head, one row."""
    tied = GPT(GPTConfig(**TINY))
    linears = [m for m in tied.transformer.h.modules() if isinstance(m, torch.nn.Linear)]
    rest = sum(p.numel() for p in tied.transformer.h.parameters()) - sum(
        p.numel() for m in linears for p in m.parameters()) + sum(p.numel() for p in tied.transformer.ln_f.parameters())
    matrices = sum(m.weight.numel() + 4 * m.out_features * (1 + (m.bias is not None)) for m in linears)
    int8 = inference_model(tied, runtime.Runtime("cpu", "cpu", "float32"), quantize="int8")[0]
    C, V = 16, 40
    assert bandwidth.decode_weight_bytes(int8) == 4 * (rest + C + C) + matrices + V * C + 4 * V


def test_kv_bytes_and_the_bound():
    """Keys and values of every layer and kv head over the attended context; grouped-query attention
    reads fewer. The bound is every byte at the bandwidth."""
    c = GPTConfig(**TINY)
    assert bandwidth.kv_cache_bytes(c, context=8, itemsize=4) == 2 * 2 * 2 * 8 * 8 * 4
    gqa = GPTConfig(**TINY | dict(n_head=4, n_kv_head=1))
    assert bandwidth.kv_cache_bytes(gqa, context=8, itemsize=4, batch_size=3) == 2 * 2 * 3 * 1 * 8 * 4 * 4
    assert bandwidth.bound_s(3_000, 1_000, 2_000.0) == 2.0
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        bandwidth.bound_s(1, 1, 0.0)


def test_copy_bandwidth_counts_the_read_and_the_write_of_the_fastest_copy():
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.75])  # copies of 0.5, 0.25 and 0.75 s
    n = 1 << 20
    assert bandwidth.copy_bandwidth(n, repeats=3, clock=lambda: next(ticks)) == 2 * n / 0.25


def test_cached_step_is_the_median_of_the_timed_steps_wall_and_cpu():
    """Scripted clocks: one warm-up step, then steps of 3, 1 and 2 s wall (0.3, 0.1, 0.2 s CPU); the cache
    is fed at the same position every time, so the context never overflows block_size."""
    wall = iter([0, 9, 10, 13, 20, 21, 30, 32])
    cpu = iter([0, 0.9, 1.0, 1.3, 2.0, 2.1, 3.0, 3.2])
    model = GPT(GPTConfig(**TINY)).eval()
    step = bandwidth.step_times(bandwidth.cached_step(model, context=8), warmup=1, repeats=3, clock=lambda: next(wall),
                                cpu_clock=lambda: next(cpu))
    assert step == pytest.approx((2.0, 0.2))


def test_measure_puts_each_step_against_its_bound(monkeypatch):
    """A faked bandwidth and step: each row's bound is its bytes / bandwidth and the ratio the step over it;
    bfloat16 rows exactly where the CPU computes it natively, with half the bytes."""
    monkeypatch.setattr(bandwidth, "copy_bandwidth", lambda **kw: 1e9)  # 1 GB/s: the bound in ms is MB read
    monkeypatch.setattr(bandwidth, "step_times", lambda step, repeats, synchronize: (0.05, 0.04))
    for native in (False, True):
        monkeypatch.setattr(cpu, "cpu_native_bf16", lambda: native)
        r = bandwidth.measure(["quickstart"], runtime.Runtime("cpu", "cpu", "float32"), steps=2)
        assert [row["dtype"] for row in r["rows"]] == ["float32"] + ["bfloat16"] * native
        f32 = r["rows"][0]
        assert f32["context"] == 64 and f32["kv_bytes"] == 2 * 4 * 4 * 64 * 32 * 4
        assert f32["bound_ms"] == pytest.approx((f32["weight_bytes"] + f32["kv_bytes"]) / 1e6)
        assert f32["step_over_bound"] == pytest.approx(50 / f32["bound_ms"])
        assert (f32["step_ms"], f32["step_cpu_ms"]) == pytest.approx((50, 40))
    assert r["rows"][1]["bound_ms"] == pytest.approx(f32["bound_ms"] / 2)
    text = bandwidth.table(r)
    assert "copy bandwidth 1.0 GB/s" in text and re.search(rf"\| +{f32['step_over_bound']:.2f}x \|", text)
