"""llama.cpp's converter (convert_hf_to_gguf.py) on exported folders, every tensor checked.

    bash scripts/fetch_llama_converter.sh        # once: the converter from llama-cpp-python's source package
    python -m pytest tests/test_gguf.py -q

Each recipe that exports with GPT-2's BPE (GPT2LMHeadModel, LlamaForCausalLM with and without Llama 3's
scaled RoPE, Qwen3ForCausalLM with a head_dim of its own; Qwen2ForCausalLM exports only an imported Qwen2
folder with its own tokenizer) goes
through the converter as it is; every tensor of the GGUF (gguf.GGUFReader) equals the folder's
safetensors tensor it came from, in the layout llama.cpp computes with (GPT-2's Conv1D transposed,
Llama's q and k rows reordered for llama.cpp's rotation of adjacent pairs). A BPE with Llama 3's
split regex has a hash the converter does not know; export.py --format=gguf names its
pre-tokenizer "llama-bpe", and the regex is checked against the one llama.cpp's C++ implements under
that name. The converter is found in $LLAMA_CPP_CONVERTER_DIR or fetch_llama_converter.sh's cache;
without it these tests skip, saying so.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import export
from core.data.tokenizer import SPLIT_PATTERN, GPT2Tokenizer, HFTokenizer
from core.errors import UserError
from core.weights.gguf import converter_dir, pre_tokenizer_name
from model import GPT, GPTConfig, llama3_frequencies
from tests.helpers import REPO_ROOT, make_gpt2_dataset, needs_transformers, run_script, train_tiny, use_gpt2_bpe

needs_transformers()
gguf = pytest.importorskip("gguf", reason="needs the gguf package (pip install gguf; requirements-dev.txt)")
CONVERTER = converter_dir()
if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
    pytest.skip(f"llama.cpp's converter is not at {CONVERTER}: run bash scripts/fetch_llama_converter.sh "
                "(or set LLAMA_CPP_CONVERTER_DIR)", allow_module_level=True)

LLAMA = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
RECIPES = {  # every class an exported recipe takes with GPT-2's BPE, and llama.cpp's architecture for it
    "gpt2": (dict(bias=True), "GPT2LMHeadModel", gguf.MODEL_ARCH.GPT2),
    "llama-gqa-untied": (LLAMA | dict(n_kv_head=2, tie_embeddings=False), "LlamaForCausalLM", gguf.MODEL_ARCH.LLAMA),
    "llama-bias": (LLAMA | dict(bias=True), "LlamaForCausalLM", gguf.MODEL_ARCH.LLAMA),
    "llama3-rope": (LLAMA | dict(rope_type="llama3", rope_factor=32.0, rope_original_max_positions=16),
                    "LlamaForCausalLM", gguf.MODEL_ARCH.LLAMA),  # Llama 3.2's scaling, its bands inside 64 positions
    "qwen3-head-dim": (LLAMA | dict(qk_norm=True, n_kv_head=2, head_dim=16), "Qwen3ForCausalLM", gguf.MODEL_ARCH.QWEN3),
}
BLOCK = 64


def random_model(vocab_size: int, **switches) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=vocab_size, n_layer=2, n_head=4, n_embd=32, **switches))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.2)  # gains and biases away from their init: a dropped or swapped one shows
    return model.eval()


def run_converter(hf_dir: Path, out: Path) -> subprocess.CompletedProcess:
    """llama.cpp's converter itself, as a user runs it."""
    env = os.environ | {"PYTHONPATH": str(CONVERTER / "site")}  # sentencepiece, fetched beside it
    return subprocess.run([sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile",
                           str(out), "--outtype", "f32"], capture_output=True, text=True, env=env, timeout=600)


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows of each head from our rotation layout, channel i with i + hs/2 (transformers'
    rotate_half), to llama.cpp's LLAMA layout, channel 2i with 2i + 1."""
    return w.reshape(heads, 2, w.size(0) // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def expected_tensors(hf_dir: Path, arch: str, gguf_arch, config: GPTConfig | None = None) -> dict[str, torch.Tensor]:
    """The folder's safetensors under GGUF names, in the layout llama.cpp computes with; for Llama 3's
    scaled RoPE also rope_freqs, each frequency's divisor (llama.cpp divides by it, we multiply)."""
    from safetensors.torch import load_file

    hf_config = json.loads((hf_dir / "config.json").read_text())
    layers = hf_config.get("n_layer") or hf_config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf_arch, layers)
    out = {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if arch == "GPT2LMHeadModel" and name.endswith(".weight") and name.removesuffix(".weight").endswith(
                ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")):
            t = t.t()  # GPT-2's Conv1D stores (in, out)
        if arch == "LlamaForCausalLM" and ("q_proj" in name or "k_proj" in name):
            heads = hf_config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            t = halves_to_pairs(t, heads)
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t
    if config is not None and config.rope_llama3 is not None:
        hs = config.head_size
        inv_freq = config.rope_base ** -(torch.arange(0, hs, 2, dtype=torch.float64) / hs)
        out["rope_freqs.weight"] = (inv_freq / llama3_frequencies(inv_freq, *config.rope_llama3)).float()
    return out


def read_gguf(path: Path):
    reader = gguf.GGUFReader(path)
    tensors = {t.name: torch.from_numpy(t.data.copy()).reshape(*reversed([int(d) for d in t.shape]))
               for t in reader.tensors}
    return reader, tensors


def field(reader, key):
    return reader.fields[key].contents()


def assert_tensors_match(reader_tensors: dict, expected: dict, tied: bool) -> None:
    if tied and "output.weight" in reader_tensors:  # the converter may write the tied head out again
        torch.testing.assert_close(reader_tensors.pop("output.weight"), expected["token_embd.weight"], rtol=0, atol=0)
    assert sorted(reader_tensors) == sorted(expected)
    for name, t in expected.items():
        if name == "rope_freqs.weight":  # computed by the converter in float32, by us in float64
            torch.testing.assert_close(reader_tensors[name], t, rtol=1e-6, atol=0)
        else:
            assert torch.equal(reader_tensors[name], t.float()), name


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_converter_takes_each_recipe_with_gpt2_bpe(recipe, tmp_path):
    switches, arch, gguf_arch = RECIPES[recipe]
    use_gpt2_bpe()
    model = random_model(50304, **switches)
    assert export.export(model, GPT2Tokenizer(), tmp_path / "hf") == arch
    result = run_converter(tmp_path / "hf", tmp_path / "model.gguf")
    assert result.returncode == 0, result.stderr[-3000:]
    reader, tensors = read_gguf(tmp_path / "model.gguf")
    prefix = gguf.MODEL_ARCH_NAMES[gguf_arch]
    assert field(reader, "general.architecture") == prefix
    assert field(reader, f"{prefix}.context_length") == BLOCK  # GPT-2's from n_ctx
    assert field(reader, f"{prefix}.block_count") == 2
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert field(reader, "tokenizer.ggml.eos_token_id") == field(reader, "tokenizer.ggml.bos_token_id") == 50256
    assert_tensors_match(tensors, expected_tensors(tmp_path / "hf", arch, gguf_arch, model.config),
                         model.config.tie_embeddings)


def test_a_wrong_rope_layout_fails_the_tensor_check(tmp_path):
    """The control: were the q/k rows left in our halves layout (no reordering), the check fails."""
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)
    assert not torch.equal(halves_to_pairs(w, 4), w)
    assert torch.equal(halves_to_pairs(w, 4)[:2], w[[0, 4]])  # head 0: channel 0 then its partner hs/2 = 4


# --- a BPE that is not GPT-2's: Llama 3's split regex ----------------------------------------------------------------

def llama3_bpe(vocab_size: int = 400) -> str:
    """A byte-level BPE trained with the `tokenizers` library on Llama 3's split regex, as Llama 3's
    own tokenizer.json builds it (Split, then ByteLevel without its own regex); its tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 50 +
            "It's 1,234.5 don't  I'll we've   tabs\t\tand 日本語 🦙\r\n" * 20)
    tok.train_from_iterator([text], trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory):
    tokenizer_json = llama3_bpe()
    tok = HFTokenizer(tokenizer_json, eot_token=0)  # <|endoftext|>, the trainer's first special token
    assert tok.backend.id_to_token(0) == "<|endoftext|>"
    path = tmp_path_factory.mktemp("llama3-bpe") / "hf"
    model = random_model(tok.vocab_size, **LLAMA, n_kv_head=2)
    export.export(model, tok, path)
    return path, tok


@pytest.mark.slow
def test_a_llama3_regex_bpe_converts_as_llama_bpe(llama3_folder, tmp_path):
    path, tok = llama3_folder
    plain = run_converter(path, tmp_path / "plain.gguf")
    assert plain.returncode != 0 and "BPE pre-tokenizer was not recognized" in plain.stderr, plain.stderr[-2000:]
    result = subprocess.run([sys.executable, str(REPO_ROOT / "export.py"), "--format=gguf", f"--hf_dir={path}",
                             f"--gguf={tmp_path / 'model.gguf'}"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reader, tensors = read_gguf(tmp_path / "model.gguf")
    assert field(reader, "tokenizer.ggml.model") == "gpt2"  # llama.cpp's name for byte-level BPE
    assert field(reader, "tokenizer.ggml.pre") == "llama-bpe"
    assert field(reader, "tokenizer.ggml.eos_token_id") == 0
    # No start token in the folder (its tokenizer names <|endoftext|> as bos only for CTranslate2's sake): said,
    # or llama.cpp's llama-bpe would put a start token before every prompt (tests/test_peers.py reads one).
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.ggml.bos_token_id") == 0
    vocab = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    assert field(reader, "tokenizer.ggml.tokens") == vocab
    merges = json.loads(tok.json)["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(m) if isinstance(m, list) else m for m in merges]
    assert_tensors_match(tensors, expected_tensors(path, "LlamaForCausalLM", gguf.MODEL_ARCH.LLAMA), True)


@pytest.mark.slow
def test_export_py_writes_a_runs_folder_then_its_gguf(tmp_path):
    """export.py --format=gguf with a new --hf_dir: the run is exported there first, then that folder converted."""
    use_gpt2_bpe()
    make_gpt2_dataset(tmp_path / "data", ["First Citizen: Before we proceed any further, hear me speak."] * 40)
    train_tiny(tmp_path / "run", tmp_path / "data", max_iters=2)
    hf_dir, out = tmp_path / "hf", tmp_path / "run.gguf"
    result = run_script("export.py", f"--out_dir={tmp_path / 'run'}", f"--hf_dir={hf_dir}", "--format=gguf",
                        f"--gguf={out}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"wrote {out} from {hf_dir}"
    assert (hf_dir / "model.safetensors").is_file()
    _, tensors = read_gguf(out)
    assert_tensors_match(tensors, expected_tensors(hf_dir, "GPT2LMHeadModel", gguf.MODEL_ARCH.GPT2), True)


def test_llama_bpe_is_the_regex_llama_cpp_implements():
    """llama.cpp's C++ names the tokenizer.json regex it reimplements for LLAMA_VOCAB_PRE_TYPE_LLAMA3 in a
    comment; that is SPLIT_PATTERN, and "llama-bpe" is one of the names that selects it."""
    source = (CONVERTER / "src" / "llama-vocab.cpp").read_text()
    case = source[source.index("case LLAMA_VOCAB_PRE_TYPE_LLAMA3:"):]
    comment = re.search(r'original regex from tokenizer\.json\s*//"(.*)",\n', case).group(1)
    assert comment.encode().decode("unicode_escape") == SPLIT_PATTERN
    selects = source[:source.index("pre_type = LLAMA_VOCAB_PRE_TYPE_LLAMA3;")]
    assert 'tokenizer_pre == "llama-bpe"' in selects[selects.rindex("} else if"):]


def test_another_split_regex_is_one_line(tmp_path):
    config = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{L}+|\s+"}, "behavior": "Isolated", "invert": False}]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="no llama.cpp pre-tokenizer here is known to implement"):
        pre_tokenizer_name(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "ByteLevel"}}))
    assert pre_tokenizer_name(tmp_path) is None  # GPT-2's: the converter's hash knows it
