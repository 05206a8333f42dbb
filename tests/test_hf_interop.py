"""GPT-2 interop: logits match transformers' GPT2LMHeadModel both ways, through save_pretrained folders.

    python -m pytest tests/test_hf_interop.py

No weights are downloaded: each test builds a small random GPT-2 and saves it to a temporary folder.
Its weights are scaled up until attention is sharp (at GPT-2's init scale it is nearly uniform, and
swapping q and k or dropping the 1/sqrt(hs) would move the logits by ~1e-7); controls show that the
comparison fails for exactly those mistakes. Where transformers is installed these tests run, never skip.
"""
import json
from dataclasses import replace

import pytest
import torch

from core.decoding.decode import generate
from core.weights import hf as core_hf
from core.weights.hf import to_transformers
from model import GPT, GPTConfig
from tests.helpers import needs_transformers

transformers = needs_transformers()
TOL = dict(atol=1e-5, rtol=0)  # logits of std ~0.1; float32 rounding is ~3e-8, a broken attention 1e-2


def tiny_hf_model(**overrides):
    torch.manual_seed(0)
    kwargs = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=101,
                  bos_token_id=None, eos_token_id=None, **overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).eval()


def random_idx(vocab_size, B=2, T=64):
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


def sharp_hf_model():
    """tiny_hf_model with random biases and LayerNorms (a dropped bias would show) and q, k scaled
    up 40x: attention scores of order 10, so each query attends to a few keys, not to all alike."""
    hf = tiny_hf_model()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:  # LayerNorm gains near 1 (near 0 they would shrink every signal), biases near 0
                p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.1)
        for block in hf.transformer.h:
            block.attn.c_attn.weight[:, :64].mul_(40)  # Conv1D (in, out): q | k | v along the columns
            block.attn.c_attn.weight[:, 64:].mul_(2)
    return hf


def attention_peak(model: GPT, idx) -> float:
    """Mean over queries past the 8th of the largest attention weight (1/T for uniform attention)."""
    naive = GPT(model.config.__class__(**{**model.config.__dict__, "attn_backend": "naive"})).eval()
    naive.load_state_dict(model.state_dict())
    with torch.no_grad():
        att = naive(idx, return_attn=True)[2]  # (n_layer, B, nh, T, T)
    return att[..., 8:, :].max(-1).values.mean().item()


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_from_pretrained_matches_transformers(tmp_path, backend):
    hf = sharp_hf_model()
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path), override_args=dict(attn_backend=backend)).eval()
    assert model.config.vocab_size == 101 and model.config.block_size == 64 and model.config.bias
    idx = random_idx(101)
    assert attention_peak(model, idx) > 0.5  # sharp: uniform attention over ~36 keys would be ~0.03
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, **TOL)


def swap_q_and_k(state: dict) -> dict:
    out = dict(state)
    for name, w in state.items():
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            q, k, v = w.split(32, dim=-1)
            out[name] = torch.cat([k, q, v], dim=-1)
    return out


def drop_the_scale(state: dict) -> dict:
    """q multiplied by sqrt(hs) = 4: softmax(q k^T) instead of softmax(q k^T / sqrt(hs))."""
    out = dict(state)
    for name, w in state.items():
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            q, kv = w.split([32, 64], dim=-1)
            out[name] = torch.cat([q * 4, kv], dim=-1)
    return out


@pytest.mark.parametrize("break_it", [swap_q_and_k, drop_the_scale])
def test_parity_check_fails_for_a_broken_attention(tmp_path, break_it):
    """The control: the same comparison, against weights loaded as a broken loader or attention would,
    fails by far more than the tolerance."""
    hf = sharp_hf_model()
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path)).eval()
    core_hf.load_hf_state_dict(model, break_it(hf.state_dict()))
    idx = random_idx(101)
    with torch.no_grad():
        diff = (model(idx)[0] - hf(idx).logits).abs().max().item()
    assert diff > 100 * TOL["atol"], diff  # 0.044 with q and k swapped, 0.011 without the scale
    with pytest.raises(AssertionError):
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, **TOL)


@pytest.mark.parametrize("overrides", [dict(), dict(bias=False), dict(gelu_approximate="none")])
def test_save_pretrained_loads_in_transformers(tmp_path, overrides):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=32, **overrides)).eval()
    with torch.no_grad():  # sharp attention, and biases that matter
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p[:64].mul_(40)  # nn.Linear (out, in): q and k rows
            elif p.dim() == 1:
                p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.1)
    to_transformers(model).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")} == dict(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=97)
    assert config["activation_function"] == ("gelu" if overrides.get("gelu_approximate") == "none" else "gelu_new")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    idx = random_idx(97)
    assert attention_peak(model, idx) > 0.5
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], **TOL)


def test_round_trip_and_greedy_generation_match(tmp_path):
    hf = sharp_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    model = GPT.from_pretrained(str(tmp_path / "hf")).eval()
    to_transformers(model).save_pretrained(tmp_path / "ours")
    again = GPT.from_pretrained(str(tmp_path / "ours")).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    prompt = random_idx(101, B=1, T=6)
    ours = generate(model, prompt, 12, temperature=0)
    theirs = hf.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert_same_greedy_text(ours, theirs, hf)


def assert_same_greedy_text(ours: torch.Tensor, theirs: torch.Tensor, hf) -> None:
    """Two float32 implementations agree on the logits to TOL, not bit for bit, so their greedy texts
    are equal except where the top two logits lie within 2 * TOL: should they part, it must be at such
    a near-tie in transformers' own logits (none occurs with these weights: the texts are equal)."""
    differ = (ours != theirs)[0].nonzero()
    if len(differ) == 0:
        return
    first = int(differ[0])
    with torch.no_grad():
        top2 = hf(theirs[:, :first]).logits[0, -1].topk(2).values
    assert top2[0] - top2[1] < 2 * TOL["atol"], (first, ours.tolist(), theirs.tolist())


def test_unsupported_checkpoints_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a directory"):
        GPT.from_pretrained(str(tmp_path / "missing"))
    tiny_hf_model(activation_function="relu").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="activation_function"):
        GPT.from_pretrained(str(tmp_path))
    tiny_hf_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="override_args"):
        GPT.from_pretrained(str(tmp_path), override_args=dict(n_layer=3))


ROPE = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
EVERY_CLASS = {  # a recipe of each class the map writes, the fused and shifted tensors included
    "GPT2LMHeadModel": dict(bias=False),
    "LlamaForCausalLM": ROPE | dict(bias=True, n_kv_head=2, tie_embeddings=False, rope_type="llama3"),
    "Qwen2ForCausalLM": ROPE | dict(qkv_bias=True, n_kv_head=1),
    "Qwen3ForCausalLM": ROPE | dict(qk_norm=True, n_kv_head=2, head_dim=16),
    "ArceeForCausalLM": ROPE | dict(mlp="relu2", bias=True),
    "NemotronForCausalLM": dict(pos_embedding="rope", mlp="gelu", bias=False, tie_embeddings=False, norm_eps=1e-6),
}


def random_model(**switches) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=32, **switches)).eval()
    with torch.no_grad():  # every weight random, norms near 1: a tensor written to the wrong place shows
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
    return model


@pytest.mark.parametrize("arch", list(EVERY_CLASS))
def test_every_class_both_ways(arch):
    """Ours -> transformers gives the same logits; transformers -> ours gives back the config and every tensor."""
    model = random_model(**EVERY_CLASS[arch])
    theirs = to_transformers(model)
    assert type(theirs).__name__ == arch
    idx = random_idx(97)
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, model(idx)[0], **TOL)
    again = core_hf.from_transformers(theirs)
    # the MLP width comes back written out, and a GPT-2 folder always has biases (zeros for bias=False)
    assert again.config == replace(model.config, mlp_hidden=again.config.mlp_hidden, bias=model.config.bias or
                                   arch == "GPT2LMHeadModel")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_a_bias_ours_cannot_hold_is_refused():
    """Nemotron's LayerNorm1P always has a bias: a nonzero one with bias=False is not silently dropped."""
    model = random_model(**EVERY_CLASS["NemotronForCausalLM"])
    state = to_transformers(model).state_dict()
    state["model.norm.bias"] += 0.1
    with pytest.raises(core_hf.ConversionError, match="biases where this model has none"):
        core_hf.load_hf_state_dict(model, state)
