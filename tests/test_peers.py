"""Our exports in the two outside CPU runtimes: CTranslate2 and llama.cpp (node-llama-cpp's prebuilt build).

    pip install -r requirements-dev.txt                 # ctranslate2
    bash scripts/fetch_llama_converter.sh && bash scripts/fetch_llama_cpp.sh   # the GGUF converter, the runtime
    python -m pytest tests/test_peers.py -q

A small model of each exported class is trained on tiny Shakespeare: GPT-2 with GPT-2's BPE, Llama
(grouped kv heads, an untied head) and Qwen3 (a head_dim of its own) with a BPE trained on the same
text; then its q and k sharpened (attention far from uniform, so a wrong head order or rotation
shows) and exported with export.py as a user would. CTranslate2's TransformersConverter converts the
folder as it is, and ctranslate2.Generator's greedy ids equal ours over 32 tokens, its log-probabilities
ours within CT2_TOL; its int8 conversion loads and decodes. export.py --format=gguf writes an F32 GGUF and
tools/llama-cpp/run.mjs decodes it in llama.cpp (a float32 cache): llama.cpp's tokenizer reads the prompt
into our ids, and the same two checks, within LLAMA_CPP_TOL. Without ctranslate2, node, the
converter or the runtime, those tests skip, saying which.
"""
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import export
from core.data.tokenizer import train_bpe
from core.decoding.decode import generate
from core.weights import resolver
from core.weights.gguf import converter_dir
from tests.helpers import (NO_SHAKESPEARE, REPO_ROOT, SHAKESPEARE, make_gpt2_dataset, needs_transformers, run_main, run_script, sharpen,
                           train_tiny, use_gpt2_bpe)

needs_transformers()
RUN_MJS = REPO_ROOT / "tools" / "llama-cpp" / "run.mjs"
RUNTIME = REPO_ROOT / "tools" / "llama-cpp" / "node_modules" / "node-llama-cpp" / "package.json"
LLAMA = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
RECIPES = {  # recipe switches, the tokenizer, the class export.py must choose
    "gpt2": (dict(bias=True), "gpt2", "GPT2LMHeadModel"),
    "llama": (LLAMA | dict(n_kv_head=2, tie_embeddings=False), "bpe", "LlamaForCausalLM"),
    "qwen3": (LLAMA | dict(qk_norm=True, n_kv_head=2, head_dim=16), "bpe", "Qwen3ForCausalLM"),
}
# GPT-2's 50,257 ids make each step ~100x dearer than the trained BPE's 512, so that model is smaller and
# trains on shorter batches. 50257 rows, not 50304: CTranslate2's GPT-2 converter refuses an embedding with
# more rows than the tokenizer has ids (docs/interop.md).
TRAINING = {"gpt2": dict(vocab_size=50257, n_embd=32, block_size=64, batch_size=2, max_iters=120),
            "bpe": dict(vocab_size=512, n_embd=64, block_size=64, batch_size=8, max_iters=200)}
PROMPT = "ROMEO:\nBut, soft! what light"
NEW_TOKENS = 32
# The largest |log p| difference over the 32 steps, all in float32, on a 2-core Xeon (AVX-512): CTranslate2
# 8e-6 (Qwen3; 3e-6 the others); llama.cpp 1.5e-4 for GPT-2 (its GELU comes from a float16 table) and
# 7e-6 for Llama and Qwen3, with its flash attention off (run.mjs; on, its float16 sums give 3e-3). Adding
# 0.5 to one weight of one matrix moves them by 4.5e-4 to 5e-3.
CT2_TOL = 1e-4
LLAMA_CPP_TOL = 4e-4


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """{"gpt2" | "bpe": data dir}: the first 200,000 characters of tiny Shakespeare, in GPT-2's BPE and in a
    512-id BPE trained on them (Llama 3's split regex, which llama.cpp names llama-bpe)."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{NO_SHAKESPEARE} (the compared models are trained on it)")
    use_gpt2_bpe()
    text = SHAKESPEARE.read_text()[:200_000]
    docs = text.split("\n\n")
    gpt2 = tmp_path_factory.mktemp("gpt2-data")
    make_gpt2_dataset(gpt2, docs)
    from core.data.writer import write_dataset

    bpe = train_bpe([text], 512, ("<|endoftext|>",), progress=False)
    bpe_dir = tmp_path_factory.mktemp("bpe-data")
    ids = [i for d in docs for i in bpe.encode(d) + [bpe.eot_token]]
    write_dataset(bpe_dir, bpe.meta(), {"train": ids, "val": ids})
    return {"gpt2": gpt2, "bpe": bpe_dir}


@pytest.fixture(scope="module", params=list(RECIPES))
def exported(request, datasets, tmp_path_factory):
    """(recipe, hf dir, our model, prompt ids, our greedy ids, our logits after each (NEW_TOKENS, vocab))."""
    switches, tokenizer, arch = RECIPES[request.param]
    run = tmp_path_factory.mktemp(f"run-{request.param}")
    t = TRAINING[tokenizer]
    ckpt = train_tiny(run, datasets[tokenizer], n_layer=2, n_head=4, lr_decay_iters=t["max_iters"],
                      eval_interval=t["max_iters"], learning_rate=1e-2, log_interval=1000, **t, **switches)
    sharpen(ckpt)
    hf_dir = run / "hf"
    result = run_main(export.main, [f"--out_dir={run}", f"--hf_dir={hf_dir}"])
    assert result.returncode == 0, result.stderr
    assert arch in result.stderr
    model, tok, _ = resolver.load_model("resume", run)
    model.eval()
    prompt = tok.encode(PROMPT)
    with torch.no_grad():
        ids = generate(model, torch.tensor([prompt]), NEW_TOKENS, temperature=0.0)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + ids]))[0][0, len(prompt) - 1:-1]
    assert len(set(ids)) > 1, f"greedy output repeats one token: too weak a model to compare ({ids})"
    return request.param, hf_dir, model, prompt, ids, logits


def assert_logprobs_close(our_logits: torch.Tensor, theirs: torch.Tensor, tol: float) -> None:
    """Log-probabilities of ours (steps, vocab) against theirs, logits or log-probabilities (steps, >= vocab:
    ids past ours are a converter's padding). An id they mask (CTranslate2 holds back the end token until
    min_length) is left out of both softmaxes."""
    theirs = theirs[:, :our_logits.size(1)].double()
    masked = theirs < -1e30
    ours = torch.log_softmax(our_logits.double().masked_fill(masked, float("-inf")), -1)
    theirs = torch.log_softmax(theirs.masked_fill(masked, float("-inf")), -1)
    worst = (ours - theirs)[~masked].abs().max().item()
    assert worst < tol, f"log-probabilities differ by {worst:.2e}"


# --- CTranslate2 ----------------------------------------------------------------------------------------------------

def ct2_convert(hf_dir: Path, out: Path, quantization: str | None = None):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="needs ctranslate2 (pip install -r requirements-dev.txt)")
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out), quantization=quantization, force=True)
    return ctranslate2.Generator(str(out), device="cpu", intra_threads=1), json.loads((out / "vocabulary.json").read_text())


def ct2_greedy(generator, vocab: list[str], prompt: list[int], logprobs: bool = False):
    """CTranslate2's greedy ids after prompt (exactly NEW_TOKENS: its end token is not allowed to stop it early),
    and with logprobs its log-probabilities (NEW_TOKENS, vocab)."""
    result = generator.generate_batch([[vocab[i] for i in prompt]], max_length=NEW_TOKENS, min_length=NEW_TOKENS,
                                      sampling_topk=1, include_prompt_in_result=False, return_logits_vocab=logprobs)[0]
    if not logprobs:
        return result.sequences_ids[0], None
    return result.sequences_ids[0], torch.stack([torch.from_numpy(np.array(step)).reshape(-1) for step in result.logits[0]])


def test_ctranslate2_loads_each_export_and_decodes_our_greedy_text(exported, tmp_path):
    name, hf_dir, model, prompt, ours, our_logits = exported
    generator, vocab = ct2_convert(hf_dir, tmp_path / "ct2")
    assert json.loads((tmp_path / "ct2" / "config.json").read_text())["unk_token"] == "<|endoftext|>"
    ids, logprobs = ct2_greedy(generator, vocab, prompt, logprobs=True)
    assert ids == ours
    assert_logprobs_close(our_logits, logprobs, CT2_TOL)


def test_ctranslate2_int8_loads_and_decodes(exported, tmp_path):
    """int8 weights: loads and decodes; its text may part from float32's, so only its start is compared."""
    name, hf_dir, model, prompt, ours, _ = exported
    generator, vocab = ct2_convert(hf_dir, tmp_path / "ct2-int8", quantization="int8")
    ids, _ = ct2_greedy(generator, vocab, prompt)
    assert len(ids) == NEW_TOKENS and ids[:4] == ours[:4]


# --- llama.cpp through node-llama-cpp -------------------------------------------------------------------------------

def llama_cpp_ready() -> None:
    if shutil.which("node") is None:
        pytest.skip("needs node (Node.js) for llama.cpp's runtime (node-llama-cpp); not on PATH")
    if not RUNTIME.is_file():
        pytest.skip(f"llama.cpp's runtime is not at {RUNTIME.parent}: run bash scripts/fetch_llama_cpp.sh")
    if not (converter_dir() / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp's converter is not fetched: run bash scripts/fetch_llama_converter.sh")


def llama_cpp_run(gguf: Path, *args: str) -> dict:
    result = subprocess.run(["node", str(RUN_MJS), f"--model={gguf}", f"--tokens={NEW_TOKENS}", "--threads=1", *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_llama_cpp_runs_each_export_and_decodes_our_greedy_text(exported, tmp_path):
    llama_cpp_ready()
    name, hf_dir, model, prompt, ours, our_logits = exported
    gguf = tmp_path / "model-f32.gguf"
    result = run_script("export.py", "--format=gguf", f"--hf_dir={hf_dir}", f"--gguf={gguf}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = llama_cpp_run(gguf, f"--text={PROMPT}", "--logprobs", "--kv_cache=F32")
    assert out["prompt"] == prompt  # llama.cpp's tokenizer reads the text into our ids (no start token added)
    assert out["ids"] == [ours]
    logprobs = torch.tensor([[float("-inf") if v is None else v for v in row] for row in out["logprobs"]])
    assert_logprobs_close(our_logits, logprobs, LLAMA_CPP_TOL)
