"""GPT-2 interop: logits match transformers' GPT2LMHeadModel both ways, through save_pretrained folders.

    python -m pytest tests/test_hf_interop.py

No weights are downloaded: each test builds a small random GPT-2 and saves it to a temporary folder.
"""
import json

import pytest
import torch

from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="GPT-2 interop needs transformers (requirements-dev.txt)")


def tiny_hf_model(**overrides):
    torch.manual_seed(0)
    kwargs = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=101,
                  bos_token_id=None, eos_token_id=None, **overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).eval()


def random_idx(vocab_size, B=2, T=64):
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_from_pretrained_matches_transformers(tmp_path, backend):
    hf = tiny_hf_model()
    with torch.no_grad():  # random biases and LayerNorms too, so a dropped bias would show
        for p in hf.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path), override_args=dict(attn_backend=backend)).eval()
    assert model.config.vocab_size == 101 and model.config.block_size == 64 and model.config.bias
    idx = random_idx(101)
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides", [dict(), dict(bias=False), dict(gelu_approximate="none")])
def test_save_pretrained_loads_in_transformers(tmp_path, overrides):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=32, **overrides)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")} == dict(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=97)
    assert config["activation_function"] == ("gelu" if overrides.get("gelu_approximate") == "none" else "gelu_new")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    idx = random_idx(97)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=1e-4, rtol=0)


def test_round_trip_and_greedy_generation_match(tmp_path):
    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    model = GPT.from_pretrained(str(tmp_path / "hf")).eval()
    model.save_pretrained(tmp_path / "ours")
    again = GPT.from_pretrained(str(tmp_path / "ours")).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    prompt = random_idx(101, B=1, T=6)
    ours = model.generate(prompt, 12, temperature=0)
    theirs = hf.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_unsupported_checkpoints_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a directory"):
        GPT.from_pretrained(str(tmp_path / "missing"))
    tiny_hf_model(activation_function="relu").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="activation_function"):
        GPT.from_pretrained(str(tmp_path))
    tiny_hf_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="override_args"):
        GPT.from_pretrained(str(tmp_path), override_args=dict(n_layer=3))
