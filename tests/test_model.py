"""The model: reference attention, causality, the KV cache, generation, sampling, sizes, optimizer groups.

    python -m pytest tests/test_model.py
"""
import math

import pytest
import torch
import torch.nn.functional as F

from core.decoding import decode
from core.decoding.cache import RowCache, Segments
from core.decoding.decode import draw, draw_by_sum, exponential_noise, generate, generate_stream, sample_next
from core.training.optim import build_optimizer
from model import GPT, Block, GPTConfig, KVCache, attention_weights, causal_mask, scaled_dot_product_attention

BACKENDS = ["sdpa", "naive"]


def tiny_config(**overrides):
    base = dict(block_size=32, vocab_size=61, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    return GPTConfig(**{**base, **overrides})


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def random_idx(B, T, vocab=61, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def sharp_model(seed=0, **overrides):
    """A tiny model whose next-token distribution depends on its context: embeddings and attention
    projections scaled up, so attention is peaked and far from GPT-2's near-uniform init."""
    model = tiny_model(seed, **overrides)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(30)
        model.transformer.wpe.weight.mul_(30)
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(15)
    return model


class WindowSpy:
    """Records the context window each decoding step passes to the model (decode._next_logits)."""

    def __init__(self, model, monkeypatch):
        self.windows, real = [], decode._next_logits

        def spy(m, idx, start, origin, cache, step=None):
            # what the model attends over: idx[:, start:]; with a cache, the cached tokens from origin
            # on (position 0 of the cache) and the new ones after them
            if m is model:
                self.windows.append(idx[:, start if cache is None else origin:].clone())
            return real(m, idx, start, origin, cache, step)

        monkeypatch.setattr(decode, "_next_logits", spy)


# --- reference attention -------------------------------------------------------------------

# (B, H, Tq, Tk, hs): square, more keys than queries (as with a KV cache), fewer keys than queries
SHAPES = [(2, 3, 5, 5, 8), (1, 4, 7, 7, 16), (2, 2, 3, 9, 8), (1, 1, 1, 6, 4), (3, 2, 6, 4, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_attention_matches_torch_float64(shape, causal):
    B, H, Tq, Tk, hs = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, hs, generator=g, dtype=torch.float64) for T in (Tq, Tk, Tk))
    ours = scaled_dot_product_attention(q, k, v, causal=causal)
    if causal and Tq != Tk:
        # torch's is_causal aligns the mask to the start; ours aligns to the end, so spell it out.
        # (With Tq > Tk the first rows see no key: both give zeros there.)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(Tq, Tk))
    else:
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert ours.shape == (B, H, Tq, hs)
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=0)


def test_causal_mask_is_end_aligned():
    mask = causal_mask(2, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert torch.equal(causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_fully_masked_rows_are_zero():
    # 4 queries end-aligned to 2 keys: the first two queries come before every key.
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, 2, 2, 8, dtype=torch.float64), torch.randn(1, 2, 2, 8, dtype=torch.float64)
    out = scaled_dot_product_attention(q, k, v, causal=True)
    assert not out.isnan().any()
    assert torch.all(out[:, :, :2] == 0)
    weights = attention_weights(q, k, causal=True)
    torch.testing.assert_close(weights[:, :, 2:].sum(-1), torch.ones(1, 2, 2, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


# --- the model -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_no_information_from_future_tokens(backend):
    model = tiny_model(attn_backend=backend)
    idx = random_idx(2, 12)
    j = 7
    changed = idx.clone()
    changed[:, j] = (changed[:, j] + 1) % 61
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    torch.testing.assert_close(after[:, :j], before[:, :j], atol=1e-6, rtol=0)
    assert not torch.allclose(after[:, j:], before[:, j:], atol=1e-4)


def test_sdpa_and_naive_backends_agree():
    sdpa, naive = tiny_model(attn_backend="sdpa"), GPT(tiny_config(attn_backend="naive")).eval()
    naive.load_state_dict(sdpa.state_dict())
    idx = random_idx(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(naive(idx)[0], sdpa(idx)[0], atol=1e-5, rtol=1e-5)


def test_logits_loss_and_ignore_index():
    model = tiny_model()
    idx, targets = random_idx(2, 10), random_idx(2, 10, seed=2)
    targets[0, :4] = -1
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 10, 61)
    kept = targets != -1
    torch.testing.assert_close(loss, F.cross_entropy(logits[kept], targets[kept]))
    # At init every token is about equally likely.
    assert abs(loss.item() - math.log(61)) < 0.3
    assert model(idx)[1] is None


def test_head_is_tied_and_init_is_gpt2():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=8, n_head=4, n_embd=256))
    assert model.lm_head.weight is model.transformer.wte.weight
    block = model.transformer.h[0]
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.001
    for proj in (block.attn.c_proj, block.mlp.c_proj):
        assert abs(proj.weight.std().item() - 0.02 / math.sqrt(16)) < 0.0005
    assert torch.all(block.attn.c_attn.bias == 0) and torch.all(block.ln_1.weight == 1)


def test_too_long_input_is_a_value_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="block_size"):
        model(random_idx(1, 33))


def test_defaults_are_gpt2_small():
    config = GPTConfig()
    sizes = (config.block_size, config.vocab_size, config.n_layer, config.n_head, config.n_embd)
    assert sizes == (1024, 50304, 12, 12, 768)
    assert config.dropout == 0.0 and config.bias and config.attn_backend == "sdpa"
    x = torch.linspace(-4, 4, 101)
    gpt2_gelu = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))  # "gelu_new"
    torch.testing.assert_close(Block(tiny_config()).mlp.gelu(x), gpt2_gelu)


@pytest.mark.parametrize("overrides, field", [
    (dict(n_embd=30, n_head=4), "divisible"), (dict(attn_backend="flash"), "attn_backend"),
    (dict(n_layer=0), "n_layer"), (dict(block_size=-1), "block_size"), (dict(dropout=1.0), "dropout"),
    (dict(gelu_approximate="erf"), "gelu_approximate"),
])
def test_config_validation(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


# --- attention weights (naive backend) -----------------------------------------------------

def test_attention_weights_are_returned_by_the_naive_backend():
    model = tiny_model(attn_backend="naive")
    idx = random_idx(2, 9)
    with torch.no_grad():
        logits, loss, attn = model(idx, return_attn=True)
    assert attn.shape == (2, 2, 2, 9, 9)  # (n_layer, B, nh, T, T)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 2, 2, 9))
    future = ~torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.all(attn[..., future] == 0)
    torch.testing.assert_close(logits, model(idx)[0])


def test_attention_weights_with_kv_cache_and_sdpa_refusal():
    model = tiny_model(attn_backend="naive")
    cache = model.new_kv_cache(1)
    model(random_idx(1, 5), kv_cache=cache)
    _, _, attn = model(random_idx(1, 3), kv_cache=cache, return_attn=True)
    assert attn.shape == (2, 1, 2, 3, 8)  # the chunk's 3 queries over all 8 positions
    assert torch.all(attn[..., 0, 6:] == 0) and torch.all(attn[..., 2, :] > 0)
    with pytest.raises(ValueError, match="naive"):
        tiny_model()(random_idx(1, 3), return_attn=True)


# --- KV cache ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_kv_cache_equals_full_forward(backend):
    model = tiny_model(attn_backend=backend)
    idx = random_idx(2, 32)
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_kv_cache(2)
        chunks, start = [], 0
        for size in [7, 1, 1, 3, 1, 5, 2, 1, 11]:  # prefill, single tokens, a few at once
            logits, _ = model(idx[:, start:start + size], kv_cache=cache)
            chunks.append(logits)
            start += size
    assert start == 32 and cache.pos == 32
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides", [dict(), dict(attn_backend="naive"), dict(pos_embedding="rope", n_kv_head=1)])
def test_rows_at_their_own_positions_equal_each_row_alone(overrides):
    """One forward over rows of different lengths (per-row positions, masked) gives each row what it gets
    alone; the cache is written per row, so the next step goes on from each row's own position."""
    torch.manual_seed(0)
    model = sharp_model(**overrides) if "wpe" in tiny_model(**overrides).transformer else tiny_model(**overrides)
    lengths = [3, 17, 9]
    idx = random_idx(3, 20)
    with torch.no_grad():
        alone = [model(idx[b:b + 1, :n + 2])[0][0, n:n + 2] for b, n in enumerate(lengths)]  # (2, V) each
        cache = RowCache(model.new_kv_cache(3))
        for b, n in enumerate(lengths):  # each row prefilled on its own slot
            model(idx[b:b + 1, :n], kv_cache=cache.rows(b, b + 1))
        assert cache.pos.tolist() == lengths
        steps = [model(torch.stack([idx[b, n + t] for b, n in enumerate(lengths)])[:, None], kv_cache=cache)[0]
                 for t in range(2)]  # (3, 1, V) each: every row's next token at its own position
    assert cache.pos.tolist() == [n + 2 for n in lengths]
    for b in range(3):
        torch.testing.assert_close(torch.cat([steps[0][b], steps[1][b]]), alone[b], atol=1e-5, rtol=0)



@pytest.mark.parametrize("overrides", [dict(), dict(attn_backend="naive"), dict(pos_embedding="rope", n_kv_head=1)])
def test_rows_at_one_position_give_the_plain_caches_floats(overrides, monkeypatch):
    """A RowCache whose rows are all at one position (prompts fed together, a request's n rows) takes the plain
    KVCache's path: no mask, so the kernels and the very floats of generate's cache on any device (a masked
    attention is another kernel on CUDA), for chunks and single tokens, and the same keys."""
    model = sharp_model(**overrides) if "wpe" in tiny_model(**overrides).transformer else tiny_model(**overrides)
    idx = random_idx(3, 12)
    plain, rows = model.new_kv_cache(3), RowCache(model.new_kv_cache(3))
    masks, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: masks.append(kw["attn_mask"]) or sdpa(*a, **kw))
    with torch.no_grad():
        for a, b in [(0, 5), (5, 6), (6, 9), (9, 10)]:
            assert torch.equal(model(idx[:, a:b], kv_cache=rows)[0], model(idx[:, a:b], kv_cache=plain)[0])
    assert rows.pos.tolist() == [10] * 3 and torch.equal(rows.k[:, :, :, :10], plain.k[:, :, :, :10])
    assert len(masks) == (0 if model.config.attn_backend == "naive" else 16)
    assert all(m is None or m.dim() == 2 for m in masks)  # generate's: none, or the chunk's (T, Tk) causal mask


@pytest.mark.parametrize("overrides", [dict(), dict(attn_backend="naive"), dict(pos_embedding="rope", n_kv_head=1)])
def test_segments_side_by_side_equal_each_view_fed_alone(overrides):
    """cache.Segments: rows 0..2 decoding one token each at their own positions (slot 1 a dummy at 0, as the
    engine's), and two chunks through rows of their own, one filling the whole context, in one forward of one row:
    each row's last logits, keys and position are what feeding each view alone gives."""
    model = sharp_model(**overrides) if "wpe" in tiny_model(**overrides).transformer else tiny_model(**overrides)
    B = model.config.block_size
    joined, alone = RowCache(model.new_kv_cache(5)), RowCache(model.new_kv_cache(5))
    step, chunks = random_idx(3, 1), {3: random_idx(1, 5), 4: random_idx(1, B)}
    with torch.no_grad():
        for cache in (joined, alone):
            model(random_idx(1, 6), kv_cache=cache.rows(0, 1))
            model(random_idx(1, 2), kv_cache=cache.rows(2, 3))
            model(chunks[3][:, :2], kv_cache=cache.rows(3, 4))  # slot 3 holds 2 of its tokens already
        expected = [model(step, kv_cache=alone.rows(0, 3), last_only=True)[0][:, 0]]
        expected += [model(chunks[s][:, int(alone.pos[s]):], kv_cache=alone.rows(s, s + 1), last_only=True)[0][:, 0]
                     for s in (3, 4)]
        parts = [(joined.rows(0, 3), 1), (joined.rows(3, 4), 3), (joined.rows(4, 5), B)]
        idx = torch.cat([step[:, 0], chunks[3][0, 2:], chunks[4][0]])[None]  # (1, 3 + 3 + B)
        got = model(idx, kv_cache=Segments(parts), last_only=True)[0][:, 0]
    assert joined.pos.tolist() == alone.pos.tolist() == [7, 1, 3, 5, B]
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(joined.k, alone.k, atol=1e-5, rtol=0)
    torch.testing.assert_close(joined.v, alone.v, atol=1e-5, rtol=0)


def test_kv_cache_capacity_and_reset():
    model = tiny_model()
    cache = model.new_kv_cache(1, max_len=6)
    assert isinstance(cache, KVCache) and cache.k.shape == (2, 1, 2, 6, 8)
    model(random_idx(1, 4), kv_cache=cache)
    with pytest.raises(ValueError, match="KV cache"):
        model(random_idx(1, 3), kv_cache=cache)
    with pytest.raises(ValueError, match="batch"):
        model(random_idx(2, 1), kv_cache=cache)
    cache.reset()
    assert cache.pos == 0
    model(random_idx(1, 6), kv_cache=cache)


# --- generation ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(top_k=1)])
@pytest.mark.parametrize("window_shift", [1, 5, 8])
def test_cached_and_uncached_greedy_agree_past_block_size(backend, sampling, window_shift):
    model = tiny_model(attn_backend=backend, block_size=16)
    idx = random_idx(2, 5)
    cached = generate(model, idx, 40, use_cache=True, window_shift=window_shift, **sampling)
    uncached = generate(model, idx, 40, use_cache=False, window_shift=window_shift, **sampling)
    assert cached.shape == (2, 45)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :5], idx)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("prompt, window_shift, starts", [
    (5, 1, [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]),  # nanoGPT's rule: always exactly the last 8 tokens
    (5, 4, [0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8]),  # after a shift, 8 - 4 + 1 = 5 tokens, growing back to 8
    # a prompt longer than block_size: the first window is already its last 8 tokens, out[4:12]
    (12, 1, [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]),
    (12, 4, [4, 8, 8, 8, 8, 12, 12, 12, 12, 16, 16, 16]),
])
def test_each_step_sees_exactly_its_window(monkeypatch, use_cache, prompt, window_shift, starts):
    """block_size 8, 12 new tokens: step i (making token prompt + i) must see out[start:prompt + i].
    The window is read where it enters the model, not inferred from the tokens: a random model's greedy
    output soon repeats one token, so a window one token short would give the same tokens."""
    model = sharp_model(block_size=8)
    spy = WindowSpy(model, monkeypatch)
    out = generate(model, random_idx(1, prompt), 12, temperature=0, window_shift=window_shift, use_cache=use_cache)
    assert len(spy.windows) == 12
    for i, (window, start) in enumerate(zip(spy.windows, starts)):
        assert torch.equal(window, out[:, start:prompt + i]), (i, window.tolist(), start)


def test_vocab_size_keeps_padded_ids_out():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    out = generate(model, random_idx(4, 2), 50, temperature=50.0, vocab_size=5, generator=g)
    assert int(out[:, 2:].max()) < 5


def test_prompt_longer_than_block_size():
    model = tiny_model(block_size=8)
    idx = random_idx(1, 12)
    assert torch.equal(generate(model, idx, 5, temperature=0), generate(model, idx, 5, temperature=0, use_cache=False))


def test_generate_and_generate_stream_equal_a_plain_sampling_loop():
    """An independent reference: full forward of the whole context, softmax(logits / T), one draw from the
    same seeded generator, append. generate (with and without the cache) and generate_stream must match it."""
    model = sharp_model()
    idx = random_idx(2, 4)
    reference, g = idx, torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(6):
            probs = torch.softmax(model(reference)[0][:, -1] / 0.8, dim=-1)
            reference = torch.cat([reference, torch.multinomial(probs, 1, generator=g)], dim=1)
    steps = list(generate_stream(model, idx, 6, temperature=0.8, generator=torch.Generator().manual_seed(3)))
    assert len(steps) == 6 and all(t.shape == (2, 1) for t in steps)
    assert torch.equal(torch.cat([idx, *steps], dim=1), reference)
    for use_cache in (True, False):
        out = generate(model, idx, 6, temperature=0.8, use_cache=use_cache, generator=torch.Generator().manual_seed(3))
        assert torch.equal(out, reference), use_cache
    assert len(set(reference[:, 4:].flatten().tolist())) > 3


def test_generator_makes_sampling_reproducible():
    model = tiny_model()
    idx = random_idx(3, 4)
    a = generate(model, idx, 10, top_p=0.9, generator=torch.Generator().manual_seed(7))
    b = generate(model, idx, 10, top_p=0.9, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_eot_stops_rows_and_pads():
    model = tiny_model()
    idx = random_idx(2, 4)
    greedy = generate(model, idx, 8, temperature=0)
    eot = int(greedy[0, 4])  # row 0's first new token
    out = generate(model, idx, 8, temperature=0, eot_token=eot)
    assert torch.all(out[0, 4:] == eot)
    row1 = greedy[1, 4:].tolist()
    stop = row1.index(eot) + 1 if eot in row1 else len(row1)
    assert out[1, 4:4 + stop].tolist() == row1[:stop] and torch.all(out[1, 4 + stop:] == eot)
    # A single row that is done stops generation early.
    assert generate(model, idx[:1], 8, temperature=0, eot_token=eot).shape == (1, 5)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(max_new_tokens=-1)])
def test_generate_validates_arguments_before_any_work(kwargs):
    model = tiny_model()
    args = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError):
        generate_stream(model, random_idx(1, 2), **args)


# --- sampling ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.01)])
def test_sample_next_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        sample_next(torch.zeros(1, 5), **kwargs)


def test_sample_next_greedy_top_k_and_top_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(2000, 1)  # (2000, 4): many draws at once
    g = torch.Generator().manual_seed(0)
    assert torch.all(sample_next(logits, temperature=0.0) == 1)
    assert torch.all(sample_next(logits, top_k=1, generator=g) == 1)
    assert set(sample_next(logits, top_k=2, generator=g).unique().tolist()) == {1, 3}
    assert set(sample_next(logits, top_p=0.5, generator=g).unique().tolist()) == {1}
    assert set(sample_next(logits, top_p=0.7, generator=g).unique().tolist()) == {1, 3}
    assert set(sample_next(logits, top_p=0.9, generator=g).unique().tolist()) == {1, 2, 3}
    assert set(sample_next(logits, top_p=1.0, generator=g).unique().tolist()) == {0, 1, 2, 3}
    draws = sample_next(logits, generator=g)
    assert draws.shape == (2000, 1)
    freq = torch.bincount(draws[:, 0], minlength=4) / 2000
    torch.testing.assert_close(freq, probs, atol=0.04, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_divides_the_logits(temperature):
    """Frequencies of 40000 seeded draws against softmax(logits / T): Pearson's chi-square with 4 degrees of
    freedom stays under 18.47 (p = 0.001). T * logits, or no temperature at all, is far off (chi-square
    in the thousands)."""
    logits = torch.tensor([1.0, 2.0, 0.0, -1.0, 1.5])
    n = 40000
    draws = sample_next(logits.repeat(n, 1), temperature=temperature, generator=torch.Generator().manual_seed(0))
    observed = torch.bincount(draws[:, 0], minlength=5).double()

    def chi2(probs):
        expected = n * probs.double()
        return float(((observed - expected) ** 2 / expected).sum())

    assert chi2(torch.softmax(logits / temperature, -1)) < 18.47
    assert chi2(torch.softmax(logits * temperature, -1)) > 500  # the test tells the wrong rule apart
    assert chi2(torch.softmax(logits, -1)) > 500


def test_sample_next_uses_its_generator():
    logits = torch.randn(4, 100)
    a = sample_next(logits, generator=torch.Generator().manual_seed(1))
    b = sample_next(logits, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)



@pytest.mark.parametrize("vocab", [65, 50304])
def test_draw_is_torch_multinomial_bit_for_bit(vocab):
    """sample_next's draw (the exponential race, its noise from the generator) gives torch.multinomial's token
    from the same seed, and rows whose noise comes from different generators each get their own generator's."""
    for seed in range(40):
        probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 4, dim=-1)
        expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(sample_next(probs.log(), generator=torch.Generator().manual_seed(seed)), expected)
    probs = torch.softmax(torch.randn(4, vocab) * 4, dim=-1)
    noise = torch.cat([exponential_noise(probs[:1], torch.Generator().manual_seed(7)),
                       exponential_noise(probs[1:], torch.Generator().manual_seed(8))])
    assert torch.equal(draw(probs, noise), torch.cat([
        torch.multinomial(probs[:1], 1, generator=torch.Generator().manual_seed(7)),
        torch.multinomial(probs[1:], 1, generator=torch.Generator().manual_seed(8))]))


def test_draw_by_sum_draws_the_distribution_and_never_a_zero():
    """draw_by_sum (the server's draw for a request sent with no seed): over 40,000 rows each id's share is its
    probability within 4 standard errors, an id of probability 0 (at either end, between, after one 1e-4) is never
    drawn; one generator state gives one set of tokens; a NaN row is refused as draw refuses it."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2999, 0.0001, 0.0, 0.15, 0.05, 0.0])
    n = 40_000
    tokens = draw_by_sum(probs.expand(n, -1), torch.Generator().manual_seed(0))  # (n, 1)
    share = torch.bincount(tokens[:, 0], minlength=len(probs)) / n
    assert tokens.shape == (n, 1) and len(share) == len(probs)
    assert ((share - probs).abs() <= 4 * (probs * (1 - probs) / n).sqrt()).all(), share
    assert torch.equal(draw_by_sum(probs.expand(50, -1), torch.Generator().manual_seed(3)),
                       draw_by_sum(probs.expand(50, -1), torch.Generator().manual_seed(3)))
    vocab = torch.softmax(torch.randn(4, 50304, generator=torch.Generator().manual_seed(1)) * 3, dim=-1)
    vocab[:, 50257:] = 0  # a padded vocabulary's ids past the tokenizer's
    assert int(draw_by_sum(vocab.repeat(500, 1), torch.Generator().manual_seed(2)).max()) < 50257
    with pytest.raises(ValueError, match="not finite"):
        draw_by_sum(torch.tensor([[0.5, 0.5], [float("nan"), 0.5]]))


def test_sample_next_refuses_non_finite_logits():
    logits = torch.zeros(2, 10)
    logits[1, 3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        sample_next(logits, generator=torch.Generator().manual_seed(0))

# --- sizes, FLOPs, optimizer ---------------------------------------------------------------

def gpt2_small_on_meta(**overrides):
    with torch.device("meta"):  # shapes only: no memory, no init cost
        return GPT(GPTConfig(vocab_size=50257, bias=True, **overrides))


def test_gpt2_small_parameter_counts():
    model = gpt2_small_on_meta()
    assert model.get_num_params(non_embedding=False) == 124_439_808
    assert model.get_num_params() == 124_439_808 - 1024 * 768  # position embeddings left out
    assert sum(p.numel() for p in model.transformer.h[0].parameters()) == 7_087_872


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_is_shape_preserving(backend):
    config = GPTConfig(vocab_size=50257, attn_backend=backend)
    with torch.device("meta"):
        block = Block(config)
        x = torch.empty(8, 1024, 768)
        assert block(x).shape == (8, 1024, 768)
    small = Block(tiny_config(attn_backend=backend))
    assert small(torch.randn(3, 10, 16)).shape == (3, 10, 16)


def test_flops_and_mfu():
    model = gpt2_small_on_meta()
    # 6 x 123,653,376 non-embedding parameters + 12 x 12 layers x 12 heads x 64 x 1024 (PaLM appendix B):
    # 741,920,256 + 113,246,208 FLOPs per token, as nanoGPT's estimate_mfu counts them.
    assert model.flops_per_token() == 855_166_464
    # 4 sequences of 1024 tokens in 2 s against a 1 PFLOP/s peak: 3.50 TFLOP / 2 s / 1 PFLOP/s.
    mfu = model.estimate_mfu(fwdbwd_per_iter=4, dt=2.0, peak_flops=1e15)
    assert mfu == pytest.approx(0.001751380918272, rel=1e-12)
    with pytest.raises(ValueError):
        model.estimate_mfu(1, 0.0, 1e15)


def test_adamw_decays_only_matrices():
    model = tiny_model()
    opt = build_optimizer(model, "adamw", adamw_lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu")
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    grouped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert grouped == {id(p) for p in model.parameters()}  # tied head appears once
    assert len(decay["params"]) == 2 + 4 * 2  # wte, wpe, 4 matrices per block
    assert decay["fused"] and decay["lr"] == 3e-4 and decay["betas"] == (0.9, 0.95)


def test_crop_block_size():
    model = tiny_model()
    model.crop_block_size(8)
    assert model.config.block_size == 8 and model.transformer.wpe.weight.shape == (8, 16)
    assert model(random_idx(1, 8))[0].shape == (1, 8, 61)
    with pytest.raises(ValueError):
        model(random_idx(1, 9))
    with pytest.raises(ValueError):
        model.crop_block_size(9)


@pytest.mark.gpu
def test_cuda_backends_cache_and_fused_optimizer():
    model = tiny_model().cuda()
    naive = GPT(tiny_config(attn_backend="naive")).cuda().eval()
    naive.load_state_dict(model.state_dict())
    idx = random_idx(2, 32).cuda()
    with torch.no_grad():
        torch.testing.assert_close(naive(idx)[0], model(idx)[0], atol=1e-4, rtol=1e-4)
    short = idx[:, :5]
    cached = generate(model, short, 40, temperature=0)
    assert torch.equal(cached, generate(model, short, 40, temperature=0, use_cache=False))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert generate(model, short, 4, temperature=0).shape == (2, 9)
    opt = build_optimizer(model, "adamw", 1e-3, 0.1, (0.9, 0.95), "cuda")
    assert opt.param_groups[0]["fused"]


def test_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert sample_next(logits, temperature=1.0, top_p=1e-300, generator=torch.Generator().manual_seed(0)).item() == 1
