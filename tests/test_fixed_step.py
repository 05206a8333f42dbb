"""Decoding's fixed-shape step (core/decoding/cache.py's StaticCache, decode.py's FixedStep): the same greedy tokens
as the plain KV cache's step, the same shapes at every position (compiled once), and where it is chosen.

    python -m pytest tests/test_fixed_step.py
    python -m pytest tests/test_fixed_step.py -m "not slow"    # without the torch.compile run (a minute or more)

The models are trained on Shakespeare and sharpened (q and k scaled up): attention is peaked, so a key written at the
wrong slot or a mask one slot off changes the text. 300 tokens past a 32-token context slide the window many times
(each learned-position refill a prefill through the same cache), and RoPE's rolling cache wraps it.
"""
import copy

import pytest
import torch

from core import runtime
from core.decoding.cache import StaticCache
from core.decoding.decode import FixedSteps, generate, inference_model
from core.weights.resolver import load_model
from tests.helpers import ROMEO_JULIET, make_char_dataset, one_thread, sharpen, train_tiny

BLOCK = 32
EAGER = dict(compile=lambda step, device_type: step)  # FixedSteps' step uncompiled: the same function


@pytest.fixture(scope="module", params=["learned", "rope"])
def trained(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    make_char_dataset(root / "data", ROMEO_JULIET)
    ckpt = train_tiny(root / "out", root / "data", block_size=BLOCK, n_layer=2, n_embd=48, max_iters=250,
                      lr_decay_iters=250, eval_interval=250, log_interval=100, pos_embedding=request.param)
    sharpen(ckpt)
    model, tok, _ = load_model("resume", str(root / "out"))
    return model.eval(), tok


def prompts(tok, batch: int) -> torch.Tensor:
    starts = ["ROMEO:\nBut soft", "JULIET:\nO Romeo, Rome", "ROMEO:\nIt is my lad", "JULIET:\nDeny thy fath"]
    return torch.tensor([tok.encode(s[-12:]) for s in starts[:batch]])  # (batch, 12)


def both_ways(model, idx, n=300, **settings):
    """generate's tokens through the plain KV cache, then through the fixed-shape step (uncompiled)."""
    with one_thread():
        plain = generate(model, idx, n, temperature=0.0, **settings)
        fixed = generate(model, idx, n, temperature=0.0, steps=FixedSteps(model, "cpu", **EAGER), **settings)
    return plain, fixed


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fixed_step_gives_the_plain_caches_greedy_tokens(trained, batch, dtype):
    model, tok = trained
    model, _ = inference_model(copy.deepcopy(model), runtime.Runtime("cpu", "cpu", dtype))  # bf16: cast, f32 head
    plain, fixed = both_ways(model, prompts(tok, batch))
    assert len(set(plain[0, 12:].tolist())) > 8, tok.decode(plain[0].tolist())  # text, not one token repeated
    assert torch.equal(fixed, plain)


def test_rope_rolling_cache_wraps_the_fixed_steps_slots(trained):
    model, tok = trained
    if model.config.pos_embedding != "rope":
        pytest.skip("the rolling cache is RoPE's")
    plain, fixed = both_ways(model, prompts(tok, 4), rolling_cache=True, window_shift=1)
    assert torch.equal(fixed, plain)


def test_the_step_is_the_same_shapes_at_every_position(trained):
    """Each one-token call writes its row's slot and reads all block_size slots with the mask of those written: the
    cache's position is a tensor, so nothing of the step's shapes or constants changes as it moves."""
    model, tok = trained
    cache, seen = StaticCache(model, 2), []
    idx = prompts(tok, 2)
    real_write = cache.write

    def spy(k_cache, v_cache, k, v):
        keys, values, mask = real_write(k_cache, v_cache, k, v)
        seen.append((keys.shape, None if mask is None else (mask.shape, int(mask[0].sum()))))
        return keys, values, mask
    cache.write = spy
    with torch.no_grad():
        cache.feed(model, idx[:, :5])  # prefill: the plain cache's write, 5 keys, causal
        cache.feed(model, idx[:, 5:6])
        cache.feed(model, idx[:, 6:7])
    L, shape = model.config.n_layer, (2, model.config.kv_heads, BLOCK, model.config.head_size)
    assert [s[0][2] for s in seen[:L]] == [5] * L and all(s[1] is None for s in seen[:L])
    assert seen[L:] == [(shape, ((2, 1, 1, BLOCK), 6))] * L + [(shape, ((2, 1, 1, BLOCK), 7))] * L
    assert cache.pos == 7 and cache.at.tolist() == [7, 7]
    with pytest.raises(ValueError, match="KV cache holds 32 positions; 7 used, 26 more"):
        cache.feed(model, torch.zeros(2, 26, dtype=torch.long))


def test_inference_model_returns_the_captured_step_on_cuda_only(trained, monkeypatch):
    """inference_model on a CUDA runtime (its device type faked, the tensors on the CPU) returns the fixed steps, whose
    compile asks for a CUDA graph (mode="reduce-overhead") of the whole step; on the CPU, or under --compile, none."""
    model, _ = trained
    assert inference_model(copy.deepcopy(model), runtime.Runtime("cpu", "cpu", "float32"))[1] is None
    compiled, steps = inference_model(copy.deepcopy(model), runtime.Runtime("cpu", "cuda", "float32"), compile=True)
    assert steps is None and not hasattr(compiled, "fixed_steps")  # --compile: the whole model compiled instead
    cuda, steps = inference_model(copy.deepcopy(model), runtime.Runtime("cpu", "cuda", "float32"))
    assert isinstance(steps, FixedSteps) and not hasattr(cuda, "fixed_steps")  # returned, not set on the model
    calls = []
    monkeypatch.setattr(torch, "compile", lambda step, **kw: calls.append(kw) or step)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append("replay"))
    cache, step = steps.get(3)
    assert isinstance(cache, StaticCache) and cache.batch_size == 3 and cache.max_len == BLOCK
    assert calls == [dict(mode="reduce-overhead", fullgraph=True, dynamic=False)]
    with torch.no_grad():
        cache.feed(cuda, torch.zeros(3, 4, dtype=torch.long))
        assert step(torch.zeros(3, 1, dtype=torch.long)).shape == (3, 1, model.config.vocab_size)
    assert calls[-1] == "replay" and steps.get(3) == (cache, step) and cache.pos == 0


@pytest.mark.slow
def test_the_compiled_step_builds_once_and_keeps_the_tokens(trained):
    """torch.compile(fullgraph=True) of the step on a CPU: after the first build no position, refill or new generate
    recompiles it (set_stance fails on one), and the tokens are the plain cache's."""
    model, tok = trained
    if model.config.pos_embedding != "learned":
        pytest.skip("one compile is enough; learned positions refill the cache as the window slides")
    idx = prompts(tok, 1)
    with one_thread():
        plain = generate(model, idx, 60, temperature=0.0)
        steps = FixedSteps(model, "cpu")
        generate(model, idx, 2, temperature=0.0, steps=steps)  # builds it
        with torch.compiler.set_stance("fail_on_recompile"):
            fixed = generate(model, idx, 60, temperature=0.0, steps=steps)
    assert torch.equal(fixed, plain)
