"""The shapes of the small open models people fine-tune, imported, exported and sampled.

    python -m pytest tests/test_hf_models.py -q

Each config.json holds the published values of SmolLM2-135M, Qwen3-0.6B, Qwen2.5-0.5B, Llama-3.2-1B and
TinyLlama-1.1B (their config.json on the Hugging Face hub), at 2 layers, a 65-character vocabulary and a
narrower width: heads, key/value heads, the RoPE base and scaling, epsilons, tying and biases as
published, and head_dim kept apart from width / heads where the model has it so (Qwen3). transformers
writes random weights, q and k sharpened; then our logits equal transformers' to 1e-5, export.py writes
back bit-identical tensors and the same config, and sample.py's greedy text equals transformers'
generate. No weights are downloaded.
"""
import json
import string

import pytest
import torch

import export
import sample
from core.data.hf_tokenizer import load_hf_tokenizer
from core.data.tokenizer import CharTokenizer
from core.weights import hf
from tests.helpers import needs_transformers, run_main
from tests.test_hf_export import PROMPTS, attention_peak

transformers = needs_transformers()
TOL = dict(atol=1e-5, rtol=0)
NARROW = 8  # published width / NARROW, head_dim likewise, heads and key/value heads as published

# name: (published config.json values, the GPTConfig fields they must map to)
MODELS = {
    "SmolLM2-135M": (dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                          intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
                          tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu"),
                     dict(n_kv_head=3, rope_base=100000.0, tie_embeddings=True, head_dim=None)),
    "Qwen3-0.6B": (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                        intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False, hidden_act="silu"),
                   dict(qk_norm=True, n_kv_head=8, head_dim=16, norm_eps=1e-6)),
    "Qwen2.5-0.5B": (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                          intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                          max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                          max_window_layers=24, hidden_act="silu"),
                     dict(bias=False, qkv_bias=True, n_kv_head=2, head_dim=None)),
    "Llama-3.2-1B": (dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                          intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                          rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                            original_max_position_embeddings=8192, rope_type="llama3"),
                          tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu"),
                     dict(rope_type="llama3", rope_factor=32.0, rope_original_max_positions=8192, n_kv_head=8)),
    "TinyLlama-1.1B": (dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                            intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                            max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                            tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu"),
                       dict(tie_embeddings=False, n_kv_head=4, block_size=2048)),
}


def reduced(published: dict, vocab_size: int) -> dict:
    """The published config at 2 layers and 1/NARROW of the width; head_dim scaled alike, so a head_dim
    apart from width / heads stays apart."""
    config = dict(published, num_hidden_layers=2, vocab_size=vocab_size, bos_token_id=None, eos_token_id=None)
    for key in ("hidden_size", "intermediate_size", "head_dim"):
        if key in config:
            config[key] //= NARROW
    if "hidden_size" in published and "head_dim" not in published:  # Qwen2: width / heads must stay whole
        config["hidden_size"] = published["hidden_size"] // published["num_attention_heads"] // NARROW * \
            published["num_attention_heads"]
    return config


def char_backend(chars: list[str]):
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.decoder = tokenizers.decoders.Fuse()
    return backend


def write_folder(path, name: str, backend, special: dict | None = None) -> None:
    """The model's reduced config.json with random, sharpened weights, and `backend` as its tokenizer;
    `special`: {"bos_token": (text, id), "eos_token": ...} for its config and tokenizer files."""
    special = special or {}
    path.mkdir(parents=True, exist_ok=True)
    config = reduced(MODELS[name][0], backend.get_vocab_size()) | {f"{k}_id": i for k, (_, i) in special.items()}
    (path / "config.json").write_text(json.dumps(config))
    config = transformers.AutoConfig.from_pretrained(path)  # the published keys, read as a downloaded folder's
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10)
            elif pname.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(5)  # the blocks outweigh the embedding: a random tied model otherwise echoes its input
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(3.0, 0.3)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.2)  # Qwen2's q/k/v biases: a dropped or misplaced one shows
            elif p.dim() == 1:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **{k: text for k, (text, _) in special.items()}
                                         ).save_pretrained(path)


@pytest.fixture(scope="module", params=list(MODELS))
def folder(request, tmp_path_factory):
    # one vocabulary whether or not ../shared holds Shakespeare: the random weights, and so each greedy
    # text, are then the same on every machine
    chars = CharTokenizer.from_text(string.printable + "".join(PROMPTS)).itos
    path = tmp_path_factory.mktemp(request.param)
    write_folder(path, request.param, char_backend(chars))
    return request.param, path


def test_import_maps_the_shape_and_matches_transformers(folder):
    name, path = folder
    model = hf.from_folder(path)
    c = model.config
    for field, value in MODELS[name][1].items():
        assert getattr(c, field) == value, field
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(theirs).__name__ == MODELS[name][0]["architectures"][0]
    tok = load_hf_tokenizer(path)
    for text in PROMPTS:
        idx = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            torch.testing.assert_close(model(idx)[0], theirs(idx).logits, **TOL)
    assert attention_peak(model, idx) > 0.4, "attention too flat for the comparison to mean anything"


def test_export_gives_back_identical_tensors_and_config(folder, tmp_path):
    from safetensors.torch import load_file

    name, path = folder
    model = hf.from_folder(path)
    export.export(model, load_hf_tokenizer(path), tmp_path / "again")
    first, again = load_file(path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == again.keys()
    for key in first:
        assert torch.equal(first[key], again[key]), key
    assert hf.from_folder(tmp_path / "again").config == model.config
    theirs, ours = (transformers.AutoConfig.from_pretrained(p).to_dict() for p in (path, tmp_path / "again"))
    for key in ("rope_parameters", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "attention_bias",
                "mlp_bias", "use_sliding_window"):
        assert theirs.get(key) == ours.get(key), key
    head_dim = lambda d: d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]  # noqa: E731
    assert head_dim(theirs) == head_dim(ours)  # Qwen2's config leaves it to width / heads, ours writes it


def test_a_qwen2_recipe_with_our_tokenizer_does_not_export(tmp_path):
    """transformers' AutoTokenizer would read the folder's GPT-2 BPE as Qwen2Tokenizer, digits one by one."""
    from core.data.tokenizer import CharTokenizer as Chars
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=16, vocab_size=8, n_layer=1, n_head=2, n_embd=16, pos_embedding="rope",
                          norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True))
    with pytest.raises(export.UserError, match="read by transformers as Qwen2's own"):
        export.export(model, Chars(list("abcdefgh")), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_sample_py_greedy_equals_transformers_generate(folder):
    name, path = folder
    prompt = PROMPTS[1]
    result = run_main(sample.main, [f"--init_from={path}", f"--start={prompt}", "--temperature=0", "--num_samples=1",
                                    "--max_new_tokens=30", "--device=cpu", "--dtype=float32", "--stream=False"])
    assert result.returncode == 0, result.stderr
    ours = result.stdout.split(sample.SEPARATOR)[0].rstrip("\n")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    # The folder's tokenizer.json on both sides: transformers' AutoTokenizer picks Qwen2Tokenizer for a
    # qwen2 folder, which rebuilds a byte-level pre-tokenizer around this character vocabulary.
    tok = load_hf_tokenizer(path)
    out = theirs.generate(torch.tensor([tok.encode(prompt)]), max_new_tokens=30, do_sample=False)
    assert tok.decode(out[0].tolist()) == ours
    assert len(set(ours[len(prompt):])) > 3, "greedy output repeats a token: too weak a model to compare"


@pytest.mark.slow
def test_a_llama_3_2_fine_tune_resumes_exactly_and_exports(tmp_path):
    """Llama-3.2-1B's shape (llama3 RoPE scaling, tied embeddings, GQA, head_dim) with a trained BPE whose
    post-processor puts <|begin_of_text|> first: a dataset made with --tokenizer=DIR, train.py --init_from=DIR
    stopped at iteration 6, then `--init_from=resume --out_dir=RUN` alone gives the uninterrupted run's log
    (losses, lrs, evals; dropout's RNG included) and weights bit for bit, and export.py of the resumed run
    gives transformers' logits equal to ours, the scaled RoPE in its config."""
    import train
    from core.weights.resolver import load_model
    from tests.helpers import records, train_tiny
    from tests.test_tokenizer import MIXED, RESERVED, bos_backend, corpus_texts, prepare
    from core.data.tokenizer import EOT, train_bpe

    bpe = train_bpe(iter(corpus_texts() + [MIXED]), 600, RESERVED, progress=False)
    backend, bos = bos_backend(bpe)
    folder = tmp_path / "llama"
    write_folder(folder, "Llama-3.2-1B", backend,
                 {"bos_token": ("<|begin_of_text|>", bos), "eos_token": (EOT, bpe.eot_token)})
    for i, text in enumerate(corpus_texts() + [MIXED]):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"doc{i}.txt").write_text(text, encoding="utf-8")
    data = tmp_path / "data"
    prepare(f"--input={tmp_path / 'in' / '*.txt'}", f"--tokenizer={folder}", f"--out_dir={data}", "--val_fraction=0.25")
    common = dict(init_from=str(folder), block_size=32, max_iters=12, lr_decay_iters=12, warmup_iters=2,
                  log_interval=1, eval_interval=6, learning_rate=3e-3, dropout=0.1)
    train_tiny(tmp_path / "a", data, **common)
    train_tiny(tmp_path / "b", data, **(common | {"max_iters": 6}))
    resumed = run_main(train.main, ["--init_from=resume", f"--out_dir={tmp_path / 'b'}", "--max_iters=12"])
    assert resumed.returncode == 0, resumed.stderr
    assert records(tmp_path / "b", timings=False) == records(tmp_path / "a", timings=False)
    (a, _, _), (b, tok, _) = (load_model("resume", tmp_path / run) for run in "ab")
    assert b.config.rope_type == "llama3" and b.config.rope_factor == 32.0 and b.config.n_kv_head == 8
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    result = run_main(export.main, [f"--out_dir={tmp_path / 'b'}", f"--hf_dir={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    published = transformers.AutoConfig.from_pretrained(folder).to_dict()
    for key in ("rope_parameters", "num_key_value_heads", "head_dim", "tie_word_embeddings", "bos_token_id"):
        assert theirs.config.to_dict().get(key) == published.get(key), key
    idx = torch.tensor([tok.encode(MIXED)[:32]])
    with torch.no_grad():
        torch.testing.assert_close(b.eval()(idx)[0], theirs(idx).logits, **TOL)
    assert attention_peak(b, idx) > 0.4, "attention too flat for the comparison to mean anything"
