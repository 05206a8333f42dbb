"""The modern-recipe switches: each alone and all together pass the model's correctness checks;
RoPE, GQA, SwiGLU, the soft-cap and Muon do what they claim; variants survive checkpoints.

    python -m pytest tests/test_recipe.py
"""
import json
import math
import re

import pytest
import torch
import torch.nn as nn

import train
from core import config as configlib, cpu, runtime
from core.decoding.decode import generate
from core.errors import UserError
from core.training import optim
from core.weights.checkpoint import load_checkpoint
from core.weights.hf import non_gpt2_fields, to_transformers
from core.weights.resolver import load_model
from model import GPT, GPTConfig, CausalSelfAttention, apply_rope, rope_angles, swiglu_hidden
from tests.helpers import TINY_TRAIN, assert_user_error, char_data_fixture, cli_args, fake_cpu, run_script, train_tiny

ALL = dict(pos_embedding="rope", norm="rmsnorm", qk_norm=True, mlp="relu2", n_kv_head=1, tie_embeddings=False,
           logit_softcap=5.0)
VARIANTS = {
    "gpt2": {}, "rope": dict(pos_embedding="rope"), "rmsnorm": dict(norm="rmsnorm"), "qk_norm": dict(qk_norm=True),
    "relu2": dict(mlp="relu2"), "swiglu": dict(mlp="swiglu"), "gqa": dict(n_kv_head=1),
    "untied": dict(tie_embeddings=False), "softcap": dict(logit_softcap=5.0), "all": ALL,
    "all_swiglu": ALL | dict(mlp="swiglu"), "unet": dict(unet_skips=True),
    "all_speedrun": ALL | dict(unet_skips=True, zero_init_proj=True), "value_embeds": dict(value_embeds=1),
    "all_value_embeds": ALL | dict(value_embeds=1, unet_skips=True),
}
TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 40


def config(block_size=16, **overrides):
    return GPTConfig(**dict(block_size=block_size, vocab_size=29, n_layer=2, n_head=2, n_embd=16) | overrides)


@torch.no_grad()
def sharpen(model: GPT) -> GPT:
    """Weights where a wrong answer shows: unit-variance embeddings, matrices at twice the gain that
    keeps activations' scale (so greedy decoding wanders instead of repeating one token), q/k
    doubled again and qk_norm's gains raised so attention is peaked and a wrong mask, position
    or head mapping changes the output instead of being averaged away."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0.0, 1.0 if name.startswith(("transformer.wte", "transformer.wpe")) else 2.0 / math.sqrt(p.size(1)))
        if name.endswith("c_attn.weight"):
            p.mul_(2.0)
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            p.fill_(2.5)
    return model


def variant_model(overrides, seed=0, dtype=torch.float64, **cfg):
    torch.manual_seed(seed)
    return sharpen(GPT(config(**(overrides | cfg)))).to(dtype).eval()


def idx_of(B, T, seed=1):
    return torch.randint(0, 29, (B, T), generator=torch.Generator().manual_seed(seed))


data_dir = char_data_fixture(TEXT)


# --- the model checks, for every switch alone and all together ------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_naive_and_fused_attention_agree(name):
    fused = variant_model(VARIANTS[name])
    naive = GPT(config(**VARIANTS[name], attn_backend="naive")).to(torch.float64).eval()
    naive.load_state_dict(fused.state_dict())
    idx = idx_of(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(naive(idx)[0], fused(idx)[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", VARIANTS)
def test_no_information_from_the_future(name):
    model = variant_model(VARIANTS[name])
    idx = idx_of(2, 12)
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 29
    with torch.no_grad():
        before, after = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(after[:, :7], before[:, :7], atol=1e-12, rtol=0)
    assert not torch.allclose(after[:, 7:], before[:, 7:], atol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_chunked_kv_cache_equals_full_forward(name):
    model = variant_model(VARIANTS[name])
    idx = idx_of(2, 16)
    with torch.no_grad():
        full = model(idx)[0]
        cache, chunks, start = model.new_kv_cache(2), [], 0
        for size in (5, 1, 3, 1, 6):
            chunks.append(model(idx[:, start:start + size], kv_cache=cache)[0])
            start += size
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("window_shift", [1, 5])
def test_cached_and_uncached_greedy_agree_past_block_size(name, window_shift):
    model = variant_model(VARIANTS[name], block_size=8)
    idx = idx_of(2, 3)
    cached = generate(model, idx, 25, temperature=0, window_shift=window_shift)
    uncached = generate(model, idx, 25, temperature=0, use_cache=False, window_shift=window_shift)
    assert torch.equal(cached, uncached)
    assert len(set(cached[:, 3:].flatten().tolist())) >= 4  # a sharp model, not one token repeated


# --- RoPE ------------------------------------------------------------------------------------

def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 16, generator=g,
                                                                                  dtype=torch.float64)

    def score(p_q, p_k):
        rq = apply_rope(q, *rope_angles(torch.tensor([p_q]), 16, 10000.0))
        rk = apply_rope(k, *rope_angles(torch.tensor([p_k]), 16, 10000.0))
        return (rq * rk).sum().item()

    for shift in (1, 7, 1000, 123457):
        assert score(5 + shift, 2 + shift) == pytest.approx(score(5, 2), abs=1e-9)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # a different offset is a different score
    assert score(9, 9) == pytest.approx((q * k).sum().item(), abs=1e-12)  # offset 0: no rotation left


def test_rope_attention_output_is_shift_invariant():
    """A whole attention layer with rotary positions gives the same output at positions 0..T-1 and
    at 500..500+T-1: nothing in it knows absolute positions."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(config(pos_embedding="rope", n_embd=32, n_head=4)).double().eval()
    attn.c_attn.weight.data.mul_(4.0)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    with torch.no_grad():
        at0 = attn(x, rope=rope_angles(torch.arange(10), 8, 10000.0))
        at500 = attn(x, rope=rope_angles(torch.arange(500, 510), 8, 10000.0))
        unrotated = attn(x)
    torch.testing.assert_close(at500, at0, atol=1e-10, rtol=0)
    assert not torch.allclose(at0, unrotated, atol=1e-3)  # rope does act


def test_rope_model_has_no_position_table():
    model = GPT(config(pos_embedding="rope"))
    assert "wpe" not in model.transformer
    assert not any("wpe" in name for name in model.state_dict())


def test_rolling_cache_equals_the_exact_rule_with_one_layer_and_never_refills():
    """One layer: every cached rotary key stays valid as the window slides, so the rolling cache
    gives nanoGPT's window_shift=1 tokens exactly, feeding one token per step past the context."""
    model = variant_model(dict(pos_embedding="rope"), n_layer=1, block_size=8)
    idx = idx_of(2, 3)
    fed = []
    hook = model.transformer.wte.register_forward_hook(lambda m, args, out: fed.append(args[0].size(1)))
    rolling = generate(model, idx, 30, temperature=0, rolling_cache=True)
    hook.remove()
    exact = generate(model, idx, 30, temperature=0, use_cache=False, window_shift=1)
    assert torch.equal(rolling, exact)
    assert fed == [3] + [1] * 29  # one prefill, then one token at a time, also past block_size


def test_rolling_cache_is_sliding_window_attention_with_more_layers():
    """With two layers the rolling cache keeps each token's deeper keys as computed when it was
    fed: its logits equal a hand-made sliding-window forward, step by step."""
    model = variant_model(dict(pos_embedding="rope"), block_size=6)
    idx = idx_of(1, 14)
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        rolled = torch.cat([model(idx[:, t:t + 1], kv_cache=cache)[0] for t in range(14)], dim=1)
    band = torch.ones(14, 14, dtype=torch.bool).tril().triu(-5)  # each query sees the last 6 keys
    assert cache.pos == 14
    torch.testing.assert_close(rolled, sliding_window_forward(model, idx, band), atol=1e-10, rtol=0)


def sliding_window_forward(model: GPT, idx, band):
    """The rope model's forward over the whole sequence, each query limited to the keys in band."""
    import torch.nn.functional as F

    B, T = idx.shape
    x = model.transformer.wte(idx)
    rope = rope_angles(torch.arange(T), model.config.head_size, model.config.rope_base)
    for block in model.transformer.h:
        a, h = block.attn, block.ln_1(x)
        q, k, v = a.c_attn(h).split(model.config.n_embd, dim=2)
        q, k, v = (t.view(B, T, a.n_head, a.head_size).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=band).transpose(1, 2).reshape(B, T, -1)
        x = x + a.c_proj(y)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.transformer.ln_f(x))


def test_rolling_cache_refuses_learned_positions():
    with pytest.raises(ValueError, match="rolling_cache needs pos_embedding='rope'"):
        generate(GPT(config()), idx_of(1, 3), 5, rolling_cache=True)
    model = GPT(config(pos_embedding="rope"))
    cache = model.new_kv_cache(1)
    model(idx_of(1, 16), kv_cache=cache)
    with pytest.raises(ValueError, match="18 tokens exceeds block_size 16"):  # a full cache rolls one token at a time
        model(idx_of(1, 2), kv_cache=cache)


# --- norms ------------------------------------------------------------------------------------

def test_rmsnorm_replaces_every_layernorm():
    model = GPT(config(norm="rmsnorm"))
    norms = [m for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]
    assert len(norms) == 2 * 2 + 1 and all(isinstance(m, nn.RMSNorm) for m in norms)
    x = torch.randn(3, 16) + 5.0  # RMSNorm keeps the mean: only the scale is normalised
    torch.testing.assert_close(model.transformer.ln_f(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt())


def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k():
    """Normalised q and k: scaling their projections by 100 leaves the layer's output as it was,
    where plain attention turns into a near one-hot."""
    for qk_norm in (True, False):
        torch.manual_seed(0)
        attn = CausalSelfAttention(config(qk_norm=qk_norm, bias=False)).double().eval()
        x = torch.randn(2, 10, 16, dtype=torch.float64)
        with torch.no_grad():
            before = attn(x)
            attn.c_attn.weight[:32].mul_(100.0)  # the q and k rows
            after = attn(x)
        assert torch.allclose(after, before, atol=1e-4) == qk_norm  # RMSNorm's eps: not exactly 0


# --- GQA -------------------------------------------------------------------------------------

def test_gqa_with_all_heads_equals_standard_attention():
    standard = variant_model({}, n_head=4, n_embd=32)
    gqa = GPT(config(n_head=4, n_embd=32, n_kv_head=4)).to(torch.float64).eval()
    gqa.load_state_dict(standard.state_dict())  # the same projection shapes: 3C
    idx = idx_of(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx)[0], standard(idx)[0], atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_gqa_shares_each_kv_head_with_its_group_of_query_heads(backend):
    """A GQA model equals a standard one whose k/v heads are copies: query head h reads kv head
    h // (n_head // n_kv_head)."""
    gqa = variant_model(dict(n_kv_head=2), n_head=4, n_embd=32, attn_backend=backend)
    standard = GPT(config(n_head=4, n_embd=32)).to(torch.float64).eval()
    state = gqa.state_dict()
    for name in [n for n in state if n.endswith("attn.c_attn.weight") or n.endswith("attn.c_attn.bias")]:
        q, k, v = state[name].split([32, 16, 16], dim=0)
        k, v = (t.unflatten(0, (2, 8)).repeat_interleave(2, dim=0).flatten(0, 1) for t in (k, v))
        state[name] = torch.cat([q, k, v])
    standard.load_state_dict(state)
    idx = idx_of(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx)[0], standard(idx)[0], atol=1e-10, rtol=0)


def test_kv_cache_shrinks_with_n_kv_head():
    full = GPT(config(n_head=4, n_embd=32)).new_kv_cache(2)
    for kv_heads in (2, 1):
        small = GPT(config(n_head=4, n_embd=32, n_kv_head=kv_heads)).new_kv_cache(2)
        assert small.k.shape == (2, 2, kv_heads, 16, 8)
        assert full.k.numel() + full.v.numel() == (4 // kv_heads) * (small.k.numel() + small.v.numel())


# --- MLP, head, soft-cap ---------------------------------------------------------------------

@pytest.mark.parametrize("n_embd", [16, 48, 128, 384, 768, 1024, 1600])
def test_swiglu_matches_the_gelu_mlp_parameter_count(n_embd):
    def mlp_params(mlp):
        block = GPT(GPTConfig(block_size=4, vocab_size=8, n_layer=1, n_head=1, n_embd=n_embd, mlp=mlp)).transformer.h[0]
        return sum(p.numel() for p in block.mlp.parameters())

    gelu, swiglu = mlp_params("gelu"), mlp_params("swiglu")
    assert abs(swiglu - gelu) / gelu <= 0.02, (swiglu, gelu)
    assert swiglu_hidden(768) == 2048  # GPT-2 small: exactly 8C/3, a multiple of 64


def test_relu2_and_swiglu_compute_what_they_say():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16)
    relu2 = GPT(config(mlp="relu2")).transformer.h[0].mlp
    torch.testing.assert_close(relu2(x), relu2.c_proj(torch.relu(relu2.c_fc(x)) ** 2))
    swiglu = GPT(config(mlp="swiglu")).transformer.h[0].mlp
    gate, up = swiglu.c_fc(x).chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(x), swiglu.c_proj(gate * torch.sigmoid(gate) * up))


def test_untied_head_has_its_own_matrix():
    tied, untied = GPT(config()), GPT(config(tie_embeddings=False))
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.get_num_params() - tied.get_num_params() == 29 * 16


def test_softcap_bounds_the_logits():
    capped = variant_model(dict(logit_softcap=3.0))
    plain = GPT(config()).to(torch.float64).eval()
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        capped.transformer.wte.weight.mul_(5.0)  # the tied head: logits of tens
        plain.transformer.wte.weight.mul_(5.0)
        idx = idx_of(2, 16)
        raw, logits = plain(idx)[0], capped(idx)[0]
    assert raw.abs().max() > 10 and logits.abs().max() <= 3.0
    torch.testing.assert_close(logits, 3.0 * torch.tanh(raw / 3.0), atol=1e-12, rtol=0)


def test_defaults_are_gpt2_and_save_pretrained_refuses_what_no_architecture_holds(tmp_path):
    """save_pretrained writes any variant a transformers class computes (core/weights/hf.py); ALL has a soft-cap
    and q/k norm with ReLU^2, which none does, and is refused in one line naming them."""
    assert non_gpt2_fields(GPTConfig()) == [] and non_gpt2_fields(config(n_kv_head=2)) == []
    model = GPT(config(**ALL))
    with pytest.raises(ValueError) as e:
        to_transformers(model).save_pretrained(tmp_path)
    message = str(e.value)
    assert "\n" not in message and "logit_softcap=5.0" in message and "qk_norm=True" in message
    assert "nearest that exports" in message
    assert not (tmp_path / "config.json").exists()


# --- bad combinations are one line -----------------------------------------------------------

@pytest.mark.parametrize("overrides, fragment", [
    (dict(n_head=4, n_embd=32, n_kv_head=3), "n_head (4) must be divisible by n_kv_head (3)"),
    (dict(n_head=2, n_embd=18, pos_embedding="rope"), "even head size"),
    (dict(mlp="geglu"), "mlp must be one of"), (dict(norm="batchnorm"), "norm must be one of"),
    (dict(pos_embedding="alibi"), "pos_embedding must be one of"), (dict(logit_softcap=0.0), "logit_softcap"),
    (dict(value_embeds=2), "value_embeds must be an integer in [0, n_layer // 2]"),
])
def test_bad_model_combinations(overrides, fragment):
    with pytest.raises(ValueError) as e:
        config(**overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_bad_combinations_from_the_command_line():
    assert_user_error(run_script("train.py", "--n_head=4", "--n_kv_head=3"), "n_kv_head (3)")  # exit 2, one line
    for argv, fragment in ((["--n_embd=36", "--n_head=4", "--pos_embedding=rope"], "even head size"),
                           (["--optimizer=sgd"], "optimizer must be one of adamw, muon"),
                           (["--muon_lr=0"], "need muon_lr > 0")):
        with pytest.raises(UserError, match=fragment) as e:
            configlib.parse_args(train.TrainConfig, argv)
        assert "\n" not in str(e.value)


def test_muon_refuses_a_parameter_it_cannot_take():
    with pytest.raises(UserError) as e:
        optim.check_muon_params([("h.0.gain", nn.Parameter(torch.ones(8)))])
    assert "h.0.gain has shape (8,)" in str(e.value) and "\n" not in str(e.value)


# --- the optimizer ---------------------------------------------------------------------------

def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = GPT(config(tie_embeddings=False))
    opt = optim.build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95), "cpu", muon_lr=0.05)
    muon, adamw = opt.optimizers["muon"], opt.optimizers["adamw"]
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = sorted(names[id(p)] for g in muon.param_groups for p in g["params"])
    assert on_muon == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    on_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight", "transformer.ln_f.weight"} <= on_adamw
    assert len(on_muon) + len(on_adamw) == len(names)  # every parameter, once
    optim.set_lr(opt, 0.5)  # the schedule halfway: each group at half its own peak
    assert muon.param_groups[0]["lr"] == 0.025 and {g["lr"] for g in adamw.param_groups} == {5e-4}


@pytest.mark.parametrize("device, native, muon_class, ns_dtype", [
    ("cuda", True, optim.BatchedMuon, torch.bfloat16),       # A100, H100: bf16, batched per shape
    ("cuda", False, optim.BatchedMuon, torch.float32),       # V100, T4: bf16 emulated
    ("cpu", True, optim.BatchedMuon, torch.bfloat16),        # avx512_bf16 or amx_bf16: bf16, batched per shape
    ("cpu", False, optim.BatchedMuon, torch.float32),        # AVX2 laptops and desktops: bf16 emulated
])
def test_muon_newton_schulz_runs_in_bf16_only_where_bf16_is_native(monkeypatch, device, native, muon_class, ns_dtype):
    """BatchedMuon everywhere: Newton-Schulz in bf16 where the device computes it natively (CUDA from sm80, CPUs
    with AVX512-BF16 or AMX) and in float32 where bf16 matmuls are emulated."""
    monkeypatch.setattr(optim, "native_bf16", lambda device: native)
    opt = optim.build_optimizer(GPT(config()), "muon", 1e-3, 0.1, (0.9, 0.95), device)
    muon = opt.optimizers["muon"]
    assert type(muon) is muon_class and getattr(muon, "ns_dtype", None) == ns_dtype


def test_bf16_batched_muon_is_torchs_muon():
    """With ns_dtype=bfloat16 (CPUs with native bf16) BatchedMuon is torch.optim.Muon's update: bit for bit
    under the default, avx2 and avx512 capabilities of a Sapphire Rapids CPU, where bmm and mm round alike;
    the bound allows another kernel's rounding. Float32 Newton-Schulz is 1.1e-2 to 1.3e-2 away, and bf16
    through the Gram matrix (wide matrices) 1.3e-2 to 1.5e-2."""
    shapes = ((48, 16), (16, 48), (48, 16), (32, 32), (16, 48))  # tall, wide (the Gram path's shape), square
    start, _ = muon_updates(torch.optim.Muon, steps=0, shapes=shapes)
    theirs, _ = muon_updates(torch.optim.Muon, shapes=shapes)
    ours, _ = muon_updates(optim.BatchedMuon, shapes=shapes, ns_dtype=torch.bfloat16)
    for w0, o, t in zip(start, ours, theirs):
        assert ((o - t).norm() / (t - w0).norm()).item() < 1e-3


def test_bf16_newton_schulz_keeps_the_loop_on_wide_matrices():
    """In bfloat16 the Gram path's powers of x xᵀ lose the small singular values: on a decaying spectrum
    its error against the float64 iteration was 2.1, the loop's (torch's) 0.08. bf16 takes the loop."""
    from torch.optim._muon import _zeropower_via_newtonschulz, DEFAULT_A, DEFAULT_B, DEFAULT_C
    coeffs, gen = (DEFAULT_A, DEFAULT_B, DEFAULT_C), torch.Generator().manual_seed(0)
    for shape in ((128, 384), (384, 128)):
        g = decaying_spectrum(shape, gen).float()
        exact = loop_newton_schulz(g, coeffs, 5)
        error = lambda o: ((o.double() - exact).norm() / exact.norm()).item()
        ours, torchs = optim.newton_schulz(g, coeffs, 5, 1e-7, torch.bfloat16), _zeropower_via_newtonschulz(g, coeffs, 5, 1e-7)
        assert ours.dtype == torch.bfloat16 and error(ours) < 1.5 * error(torchs) < 0.2, (shape, error(ours), error(torchs))


@pytest.mark.parametrize("capability, flags, isa, native", [
    ("AVX2", {"avx2", "fma"}, None, False),                          # most laptops, desktops and this machine
    ("AVX512", {"avx512f", "avx512bw"}, None, False),                # Skylake-X: AVX-512 but no bf16 units
    ("AVX512", {"avx512f", "avx512_bf16"}, None, True),              # Cooper Lake, Zen 4
    ("AVX512", {"avx512f", "amx_bf16"}, None, True),                 # Sapphire Rapids
    ("AVX2", {"avx512f", "avx512_bf16"}, None, False),               # the same, with ATEN_CPU_CAPABILITY=avx2
    ("AVX512", {"avx512f", "avx512_bf16"}, "AVX2", False),           # ... or ONEDNN_MAX_CPU_ISA=AVX2
    ("AVX512", {"avx512f", "amx_bf16"}, "AVX512_CORE_AMX", True),
    ("DEFAULT", {"fp", "asimd", "bf16"}, None, True),                # ARM with the BF16 extension (Graviton 3)
    ("DEFAULT", {"fp", "asimd"}, None, False),
])
def test_cpu_native_bf16_reads_the_cpu_and_honours_the_capability_caps(monkeypatch, capability, flags, isa, native):
    fake_cpu(monkeypatch, capability, flags, isa)
    assert cpu.cpu_native_bf16() is native and runtime.native_bf16("cpu") is native
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert runtime.native_bf16("cpu") is False  # oneDNN does no bf16 matmuls here: they fall back to emulation


def muon_updates(muon_class, steps=3, shapes=((48, 16), (16, 48), (32, 32)), **kwargs):
    """The weights after `steps` Muon steps on fixed gradients (tall, wide and square matrices, with
    weight decay and the shape-adjusted rate, so every branch of the step is used)."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]
    opt = muon_class(params, lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="original", **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params], opt


def test_float32_muon_is_torchs_muon_but_for_the_precision_of_newton_schulz(monkeypatch):
    """BatchedMuon's step is torch's, line for line: with torch's own bf16 Newton-Schulz swapped in it
    equals torch.optim.Muon bit for bit (momentum, Nesterov, weight decay, rate adjustment, state); with
    its float32 Newton-Schulz it agrees with torch to bf16 rounding; its state loads into torch's."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    start, _ = muon_updates(torch.optim.Muon, steps=0)
    torch_weights, torch_opt = muon_updates(torch.optim.Muon)
    f32_weights, f32_opt = muon_updates(optim.BatchedMuon)
    for w0, ours, theirs in zip(start, f32_weights, torch_weights):
        ours, theirs = ours - w0, theirs - w0
        # bf16 keeps 8 bits (rounding 2^-9 = 0.2%), which 5 iterations of 3 matmuls grow to ~1%
        assert 1e-4 < ((ours - theirs).norm() / theirs.norm()).item() < 0.03
    with monkeypatch.context() as m:
        # torch's takes one matrix; ours gets equal shapes as a batch (k, m, n)
        m.setattr(optim, "newton_schulz", lambda g, coeffs, steps, eps, dtype: torch.stack(
            [_zeropower_via_newtonschulz(x, coeffs, steps, eps) for x in g]))
        swapped, _ = muon_updates(optim.BatchedMuon, shapes=((48, 16), (16, 48), (48, 16), (32, 32), (16, 48)))
        torch_weights, _ = muon_updates(torch.optim.Muon, shapes=((48, 16), (16, 48), (48, 16), (32, 32), (16, 48)))
    assert all(torch.equal(a, b) for a, b in zip(swapped, torch_weights))
    torch_opt.load_state_dict(f32_opt.state_dict())  # the same state format: a checkpoint moves between them
    assert torch.equal(torch_opt.state_dict()["state"][0]["momentum_buffer"],
                       f32_opt.state_dict()["state"][0]["momentum_buffer"])


def loop_newton_schulz(g: torch.Tensor, coeffs, steps: int) -> torch.Tensor:
    """torch's Newton-Schulz iteration (torch/optim/_muon.py) written out, in float64: the reference."""
    a, b, c = coeffs
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


def decaying_spectrum(shape, gen) -> torch.Tensor:
    """A random matrix with singular values from 1 down to 1e-3, as gradients have (close to low rank)."""
    u, _, vh = torch.linalg.svd(torch.randn(shape, generator=gen, dtype=torch.float64), full_matrices=False)
    return u @ torch.diag(torch.logspace(0, -3, min(shape), dtype=torch.float64)) @ vh


def test_gram_newton_schulz_is_the_same_iteration():
    """Through the Gram matrix the iterates are the loop's, exactly in exact arithmetic: float64 agrees to
    ~1e-13 at every step count (a wrong commuting step, or A_{k+1} = P A instead of P A P, is off by O(1))."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C
    coeffs, gen = (DEFAULT_A, DEFAULT_B, DEFAULT_C), torch.Generator().manual_seed(0)
    for shape in ((16, 48), (96, 40), (8, 8), (32, 200)):
        g = decaying_spectrum(shape, gen)
        for steps in (1, 2, 3, 5):
            ours = optim.newton_schulz(g, coeffs, steps, 1e-7, torch.float64)
            assert ((ours - loop_newton_schulz(g, coeffs, steps)).norm() / ours.norm()).item() < 1e-10, (shape, steps)


def test_newton_schulz_of_a_batch_is_each_matrix_on_its_own():
    """BatchedMuon stacks equal-shape updates (k, m, n): each matrix keeps its own norm and iteration,
    on the loop and the Gram path alike (a norm taken over the whole batch is off by O(1))."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C
    coeffs, gen = (DEFAULT_A, DEFAULT_B, DEFAULT_C), torch.Generator().manual_seed(0)
    for shape in ((16, 48), (96, 40), (24, 24)):
        batch = torch.stack([decaying_spectrum(shape, gen) * scale for scale in (1.0, 30.0, 0.01)])
        ours = optim.newton_schulz(batch, coeffs, 5, 1e-7, torch.float64)
        for x, o in zip(batch, ours):
            assert ((o - loop_newton_schulz(x, coeffs, 5)).norm() / o.norm()).item() < 1e-10, shape


def test_float32_muon_orthogonalises_each_shape_as_one_batch(monkeypatch):
    """One Newton-Schulz call per shape, holding every matrix of that shape (one per layer)."""
    calls = []
    real = optim.newton_schulz
    monkeypatch.setattr(optim, "newton_schulz", lambda g, *a: calls.append(tuple(g.shape)) or real(g, *a))
    muon_updates(optim.BatchedMuon, steps=1, shapes=((48, 16), (16, 48), (48, 16), (32, 32), (48, 16)))
    assert calls == [(3, 48, 16), (1, 16, 48), (1, 32, 32)]


def test_newton_schulz_takes_the_gram_path_where_it_costs_less(monkeypatch):
    """4m²n + (4 steps - 3) 2m³ FLOPs against steps (4m²n + 2m³): the Gram path wins past n = 1.5 m,
    in either orientation; square matrices and DTensor shards keep the loop."""
    calls = []
    real = optim.gram_newton_schulz
    monkeypatch.setattr(optim, "gram_newton_schulz", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    for shape in ((32, 96), (96, 32), (32, 32), (32, 48)):
        optim.newton_schulz(torch.randn(shape), (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert calls == [(32, 96), (32, 96)]


def test_float32_newton_schulz_is_closer_to_exact_than_bf16():
    """The orthogonalisation error (against the iteration in float64, relative Frobenius norm), measured
    on this AVX2 CPU: float32 4e-6 (the loop, square) to 8e-5 (the Gram path, wide or tall), torch's
    bf16 1e-2 on Gaussian matrices and 5e-2 to 8e-2 on a decaying spectrum (gradients are close to low
    rank). So float32 is the more exact, not merely the faster, path."""
    from torch.optim._muon import _zeropower_via_newtonschulz, DEFAULT_A, DEFAULT_B, DEFAULT_C
    coeffs, gen = (DEFAULT_A, DEFAULT_B, DEFAULT_C), torch.Generator().manual_seed(0)
    for shape in ((128, 128), (512, 128), (128, 384)):
        g = decaying_spectrum(shape, gen).float()
        exact = loop_newton_schulz(g, coeffs, 5)
        error = lambda o: ((o.double() - exact).norm() / exact.norm()).item()
        f32, bf16 = error(optim.newton_schulz(g, coeffs, 5, 1e-7)), error(_zeropower_via_newtonschulz(g, coeffs, 5, 1e-7))
        assert f32 < 3e-4 and bf16 > 1e-2, (shape, f32, bf16)


def test_adamw_groups_are_nanogpts():
    model = GPT(config())
    opt = optim.build_optimizer(model, "adamw", 1e-3, 0.1, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert [p for p in model.parameters() if p.dim() >= 2] == decay["params"]  # parameters() order: old checkpoints
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


@pytest.mark.slow
def test_muon_resume_is_exact_and_the_variant_is_rebuilt(tmp_path, data_dir):
    """A modern-recipe run stopped and resumed equals the uninterrupted run bit for bit (Muon's
    momentum and AdamW's moments both come back), and sample.py rebuilds the variant."""
    common = dict(max_iters=12, lr_decay_iters=12, warmup_iters=2, log_interval=1, eval_interval=6, n_head=4,
                  pos_embedding="rope", norm="rmsnorm", qk_norm=True, mlp="relu2", n_kv_head=2,
                  tie_embeddings=False, logit_softcap=15.0, optimizer="muon", muon_lr=0.05)
    train_tiny(tmp_path / "a", data_dir, **common)
    train_tiny(tmp_path / "b", data_dir, **(common | {"max_iters": 6}))
    train_tiny(tmp_path / "b", data_dir, **(common | {"init_from": "resume"}))
    sa, sb = load_checkpoint(tmp_path / "a" / "ckpt.pt"), load_checkpoint(tmp_path / "b" / "ckpt.pt")
    for name, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][name]), name
    assert set(sb["optimizer"]) == {"muon", "adamw"}
    assert sb["optimizer"]["muon"]["state"]  # momentum buffers were saved
    margs = sb["meta"]["model_args"]
    assert (margs["pos_embedding"], margs["n_kv_head"], margs["mlp"]) == ("rope", 2, "relu2")

    model, _, _ = load_model("resume", tmp_path / "b")
    assert model.config == GPTConfig(**margs)
    result = run_script("sample.py", f"--out_dir={tmp_path / 'b'}", "--device=cpu", "--num_samples=1",
                        "--max_new_tokens=40", "--seed=1")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) > 40


def test_resume_with_another_optimizer_or_switch_is_one_line(tmp_path, data_dir):
    train_tiny(tmp_path, data_dir, max_iters=2, optimizer="muon")
    with pytest.raises(UserError, match="optimizer=muon, this run uses optimizer=adamw"):  # given: not the run's
        train_tiny(tmp_path, data_dir, max_iters=4, init_from="resume", optimizer="adamw")
    with pytest.raises(UserError, match="config mlp='relu2' differs|config mlp=relu2 differs"):
        train_tiny(tmp_path, data_dir, max_iters=4, init_from="resume", optimizer="muon", mlp="relu2")


def test_init_from_gpt2_refuses_recipe_switches(tmp_path):
    cfg = train.TrainConfig(init_from="gpt2", pos_embedding="rope", n_embd=64, n_head=4)
    with pytest.raises(UserError, match="init_from=gpt2 loads GPT-2's architecture"):
        train.build_model(cfg, {"tokenizer": "gpt2", "vocab_size": 50257}, runtime.Runtime("cpu", "cpu", "float32"), print)


# --- the comparison command ------------------------------------------------------------------

@pytest.mark.slow
def test_compare_recipe_trains_evaluates_and_reports(tmp_path, data_dir):
    argv = cli_args(TINY_TRAIN, data_dir=data_dir, max_iters=4, lr_decay_iters=4, results_dir=tmp_path,
                    variants="classic,muon,modern", eval_every=2, timing_rounds=1, timing_iters=1)
    result = run_script("scripts/compare_recipe.py", *argv, timeout=600)  # as its docstring runs it
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {n: json.loads((tmp_path / "variants" / f"{n}.json").read_text()) for n in ("classic", "muon", "modern")}
    assert [it for it, _ in runs["classic"]["curve"]] == [0, 2, 4]
    assert runs["modern"]["overrides"] == {"pos_embedding": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
                                           "qk_norm": True, "tie_embeddings": False, "optimizer": "muon"}
    assert runs["classic"]["curve"][0][1] == pytest.approx(math.log(len(set(TEXT))), abs=0.3)
    table = (tmp_path / "table.md").read_text()  # benchmarks.common.markdown_table: cells padded to line up
    assert re.search(r"^\| +modern \|", table, re.M) and (tmp_path / "val_loss.png").stat().st_size > 1000


def test_compare_recipe_refuses_an_unknown_variant_in_one_line():
    assert_user_error(run_script("scripts/compare_recipe.py", "--variants=rope, nope", "--phase=report"),
                      "unknown variant(s) nope; choose from classic, rope")


# --- the speedrun switches (bench.py --sections=speedrun) --------------------------------------

def test_zero_init_proj_starts_every_block_as_the_identity_and_still_trains_them():
    torch.manual_seed(0)
    model = GPT(config(zero_init_proj=True)).eval()
    idx = idx_of(2, 16)
    t = model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(16))
    expected = model.lm_head(t.ln_f(x))  # no Block adds anything at the start
    torch.testing.assert_close(model(idx)[0], expected)
    torch.manual_seed(0)
    default = GPT(config())
    assert default.transformer.h[0].attn.c_proj.weight.abs().sum() > 0  # the default stays GPT-2's init
    model.train()
    opt = optim.build_optimizer(model, "adamw", 1e-2, 0.0, (0.9, 0.95), "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):  # step 1 moves c_proj off 0; step 2 then reaches c_fc and c_attn
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []


def test_zero_init_proj_is_recorded_and_rebuilt_from_model_args():
    cfg = train.TrainConfig(zero_init_proj=True, n_layer=2, n_head=2, n_embd=16, block_size=16)
    margs = cfg.model_args() | {"vocab_size": 29}
    assert margs["zero_init_proj"] is True and GPTConfig(**margs).zero_init_proj
    assert non_gpt2_fields(GPTConfig(zero_init_proj=True)) == []  # an initialisation: GPT-2 can hold the weights


def test_muon_ns_steps_reaches_torchs_muon_and_changes_the_update():
    updates = {}
    for steps in (1, 5):
        torch.manual_seed(0)
        model = GPT(config())
        opt = optim.build_optimizer(model, "muon", 1e-3, 0.0, (0.9, 0.95), "cpu", muon_ns_steps=steps)
        assert opt.optimizers["muon"].param_groups[0]["ns_steps"] == steps
        w = model.transformer.h[0].mlp.c_fc.weight
        before = w.detach().clone()
        model(idx_of(2, 16), idx_of(2, 16, seed=2))[1].backward()
        opt.step()
        updates[steps] = w.detach() - before
    assert not torch.allclose(updates[1], updates[5])


def test_lr_schedule_and_muon_ns_steps_are_checked():
    with pytest.raises(UserError, match="lr_schedule must be one of cosine, wsd"):
        configlib.parse_args(train.TrainConfig, ["--lr_schedule=linear"])
    with pytest.raises(UserError, match="muon_ns_steps must be in"):
        configlib.parse_args(train.TrainConfig, ["--muon_ns_steps=0"])
    cfg = configlib.parse_args(train.TrainConfig, ["--lr_schedule=wsd", "--learning_rate=1.0", "--min_lr=0.0",
                                                   "--warmup_iters=0", "--lr_decay_iters=10", "--cooldown_frac=0.5"])
    assert [train.get_lr(it, cfg) for it in range(11)] == pytest.approx([1, 1, 1, 1, 1, 1, .8, .6, .4, .2, 0])


def test_unet_skips_feed_block_j_output_into_block_L_minus_1_minus_j():
    torch.manual_seed(0)
    model = sharpen(GPT(config(n_layer=4, unet_skips=True))).double().eval()
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.5, -2.0]))
    seen = {}
    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(f"out{i}", out))
        block.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(f"in{i}", args[0]))
    model(idx_of(2, 16))
    torch.testing.assert_close(seen["in1"], seen["out0"])  # the first half: plain
    torch.testing.assert_close(seen["in2"], seen["out1"] + 0.5 * seen["out1"])  # block 2 reads block 1 (weight 0)
    torch.testing.assert_close(seen["in3"], seen["out2"] - 2.0 * seen["out0"])  # block 3 reads block 0 (weight 1)
    plain = GPT(config(n_layer=4)).double().eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "skip_weights"})
    with torch.no_grad():
        model.skip_weights.zero_()  # no skip: the plain model
    torch.testing.assert_close(model(idx_of(2, 16))[0], plain(idx_of(2, 16))[0])
    assert non_gpt2_fields(GPTConfig(unet_skips=True)) == ["unet_skips=True"]


def test_value_embeds_go_to_the_first_and_last_blocks_as_each_tokens_row():
    """k tables: Blocks i and L-k+i (i < k) get table i's rows of the tokens, the middle ones none; the
    default builds no table and no mixing weight (GPT-2's parameters exactly)."""
    torch.manual_seed(0)
    model = sharpen(GPT(config(n_layer=6, value_embeds=2))).double().eval()
    idx = idx_of(2, 16)
    got = {}
    for i, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(lambda m, args, i=i: got.__setitem__(i, args[-1]))
    model(idx)
    tables = [t(idx) for t in model.transformer.ve]  # (B, T, nkv * hs) each
    for i, table in {0: 0, 1: 1, 4: 0, 5: 1}.items():
        torch.testing.assert_close(got[i], tables[table])
    assert got[2] is None and got[3] is None
    with_lambdas = [i for i, b in enumerate(model.transformer.h) if hasattr(b.attn, "ve_lambdas")]
    assert with_lambdas == [0, 1, 4, 5]
    assert not [n for n, _ in GPT(config(n_layer=6)).named_parameters() if ".ve" in n]


def test_value_embeds_mix_into_v_with_their_learned_weights():
    """One position attends to itself alone, so attention returns its v: the output is
    c_proj(lambdas[0] v + lambdas[1] ve). With lambdas (1, 0) the Block is the plain one."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(config(value_embeds=1), value_embed=True).double()
    with torch.no_grad():
        attn.ve_lambdas.copy_(torch.tensor([0.7, -1.3]))
    x, ve = torch.randn(3, 1, 16, dtype=torch.float64), torch.randn(3, 1, 16, dtype=torch.float64)
    v = attn.c_attn(x)[..., 32:]  # q, k, v side by side: v is the last n_embd
    torch.testing.assert_close(attn(x, ve=ve), attn.c_proj(0.7 * v - 1.3 * ve))
    plain = CausalSelfAttention(config()).double()
    plain.load_state_dict({k: t for k, t in attn.state_dict().items() if k != "ve_lambdas"})
    with torch.no_grad():
        attn.ve_lambdas.copy_(torch.tensor([1.0, 0.0]))
    x = torch.randn(3, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(attn(x, ve=torch.randn(3, 9, 16, dtype=torch.float64)), plain(x))


def test_value_embeds_train_on_adamw_are_recorded_and_refused_by_export(tmp_path, data_dir):
    """The tables are embeddings (AdamW, decayed), the mixing weights gains (AdamW, not decayed); a
    trained run records the switch and rebuilds it; no transformers class holds it, so save_pretrained
    refuses it in one line naming the switch and the nearest recipe that exports."""
    model = GPT(config(value_embeds=1))
    opt = optim.build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95), "cpu")
    decayed, gains = opt.optimizers["adamw"].param_groups
    assert any(p is model.transformer.ve[0].weight for p in decayed["params"])
    assert any(p is model.transformer.h[0].attn.ve_lambdas for p in gains["params"])
    train_tiny(tmp_path, data_dir, max_iters=2, n_layer=2, value_embeds=1, optimizer="muon")
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["meta"]["model_args"]["value_embeds"] == 1 and "transformer.ve.0.weight" in ckpt["model"]
    loaded, _, _ = load_model("resume", tmp_path)
    assert loaded.config.value_embeds == 1
    assert non_gpt2_fields(GPTConfig(value_embeds=1)) == ["value_embeds=1"]
    modern = dict(pos_embedding="rope", norm="rmsnorm", qk_norm=True, mlp="swiglu", bias=False, tie_embeddings=False)
    with pytest.raises(ValueError) as e:
        to_transformers(GPT(config(**modern, value_embeds=1))).save_pretrained(tmp_path / "hf")
    assert "\n" not in str(e.value) and "value_embeds=1" in str(e.value)
    assert "nearest that exports: value_embeds=0 (-> Qwen3ForCausalLM)" in str(e.value)


# --- Polar Express: Newton-Schulz with one polynomial per step ------------------------------------

def polar_express_reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """modded-nanogpt's polar_express written out in float64: X / (1.02 |X|_F), then step k's polynomial."""
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / (x.norm() * 1.02)
    for a, b, c in optim.POLAR_EXPRESS[:steps]:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


def test_polar_express_is_its_reference_iteration_on_the_loop_and_the_gram_path():
    """ns_schedule folds the 2% safety factor into the first polynomial; the loop and the Gram path take
    the schedule step by step (a polynomial reused, or the fold lost, is off by O(1e-2) or more)."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((16, 48), (96, 40), (24, 24), (32, 200)):
        g = decaying_spectrum(shape, gen)
        for steps in (1, 3, 5):
            ours = optim.newton_schulz(g, optim.ns_schedule("polar_express", steps), steps, 1e-30, torch.float64)
            ref = polar_express_reference(g, steps)
            assert ((ours - ref).norm() / ref.norm()).item() < 1e-10, (shape, steps)


def test_polar_express_orthogonalises_closer_than_the_quintic_in_five_steps():
    """On singular values from 1 down to 1e-2, five steps leave the quintic's in [0.68, 1.2] and Polar
    Express's in [0.86, 1.14]. It is a five-step schedule: after its first four they reach 1.58."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C
    u, _, vh = torch.linalg.svd(torch.randn(64, 192, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
                                full_matrices=False)
    g = u @ torch.diag(torch.logspace(0, -2, 64, dtype=torch.float64)) @ vh
    spread = lambda x: (torch.linalg.svdvals(x) - 1).abs().max().item()
    quintic = optim.newton_schulz(g, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7, torch.float64)
    polar = optim.newton_schulz(g, optim.ns_schedule("polar_express", 5), 5, 1e-7, torch.float64)
    assert spread(polar) < 0.15 and spread(quintic) > 0.3
    assert spread(optim.newton_schulz(g, optim.ns_schedule("polar_express", 4), 4, 1e-7, torch.float64)) > 0.5


def test_polar_express_reaches_the_muon_step_from_the_config(monkeypatch):
    """muon_ns_coefficients=polar_express: BatchedMuon on every device (torch's step holds one polynomial),
    its group holding the schedule (saved with the optimizer), and another update than the quintic's;
    more steps than the schedule holds, or an unknown name, is one line."""
    updates = {}
    for kind in optim.NS_COEFFICIENTS:
        cfg = train.TrainConfig(optimizer="muon", muon_ns_coefficients=kind, muon_ns_steps=4, n_layer=2, n_head=2,
                                n_embd=16, block_size=16)
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg.model_args() | {"vocab_size": 29}))
        opt = train.make_optimizer(model, cfg, "cpu")
        group = opt.optimizers["muon"].param_groups[0]
        w = model.transformer.h[0].mlp.c_fc.weight
        before = w.detach().clone()
        model(idx_of(2, 16), idx_of(2, 16, seed=2))[1].backward()
        opt.step()
        updates[kind] = w.detach() - before
    assert group["ns_coefficients"] == optim.ns_schedule("polar_express", 4) and len(group["ns_coefficients"]) == 4
    assert not torch.allclose(updates["quintic"], updates["polar_express"], rtol=0.05, atol=0)
    monkeypatch.setattr(optim, "native_bf16", lambda device: True)  # an A100 or H100: torch's step for the quintic
    opt = optim.build_optimizer(GPT(config()), "muon", 1e-3, 0.1, (0.9, 0.95), "cuda",
                                muon_ns_coefficients="polar_express")
    assert type(opt.optimizers["muon"]) is optim.BatchedMuon
    for argv, fragment in ((["--muon_ns_coefficients=polar_express", "--muon_ns_steps=6"], "set muon_ns_steps to 1..5"),
                           (["--muon_ns_coefficients=cubic"], "muon_ns_coefficients must be one of quintic, polar")):
        with pytest.raises(UserError, match=fragment) as e:
            configlib.parse_args(train.TrainConfig, argv)
        assert "\n" not in str(e.value)


def test_a_resume_keeps_the_newton_schulz_settings_it_is_given():
    """Loading a checkpoint's optimizer state brings back its groups' settings; the rates and Newton-Schulz's
    steps and polynomials stay this run's (a resume may switch them, as it may the learning rates)."""
    torch.manual_seed(0)
    model = GPT(config())
    saved = optim.build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95), "cpu").state_dict()
    resumed = optim.build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95), "cpu", muon_ns_steps=3,
                                    muon_ns_coefficients="polar_express")
    optim.load_state(resumed, saved)
    group = resumed.optimizers["muon"].param_groups[0]
    assert group["ns_steps"] == 3 and group["ns_coefficients"] == optim.ns_schedule("polar_express", 3)
