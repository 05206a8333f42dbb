"""lm-evaluation-harness on exported folders: `lm_eval --model hf` with no extra arguments.

    python -m pytest tests/test_lm_eval.py -q

A character-vocabulary export and a GPT-2 BPE export each run a multiple-choice task and a generate_until
task from tests/lm_eval_tasks/ (local lines of tiny Shakespeare, no downloads). A character vocabulary
holds <|endoftext|> (after its characters), as GPT-2's does: lm_eval pads with it, starts an empty context
from it and stops generation at it, and crashed on a folder without one (TypeError: 'None' is not an
instance of 'Sequence'). Every log-likelihood lm_eval reports equals ours for the same ids, and every generation
equals our greedy text up to its stop string.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import export
from core.data.tokenizer import GPT2_VOCAB, CharTokenizer, GPT2Tokenizer
from core.decoding.decode import generate
from model import GPT, GPTConfig
from tests.helpers import REPO_ROOT, SHAKESPEARE, needs_transformers, use_gpt2_bpe

needs_transformers()
lm_eval = pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness (pip install lm_eval accelerate)")
pytest.importorskip("accelerate", reason="lm_eval's hf model needs accelerate (pip install accelerate)")
TASKS = REPO_ROOT / "tests" / "lm_eval_tasks"
BLOCK = 128  # longer than every context and choice, so lm_eval truncates nothing


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]


MC, GEN = read_jsonl("shakespeare_mc.jsonl"), read_jsonl("shakespeare_gen.jsonl")
TASK_TEXT = "".join(d["context"] + "".join(d["choices"]) for d in MC) + "".join(d["context"] + d["target"] for d in GEN)


def corpus() -> str:
    return (SHAKESPEARE.read_text()[:50_000] if SHAKESPEARE.is_file() else "") + TASK_TEXT * 20


def trained_model(tok, vocab_size: int, steps: int) -> GPT:
    """A tiny character model fitted for a few hundred steps: a random one greedily repeats one token,
    which would make the generation comparison empty."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=vocab_size, n_layer=2, n_head=4, n_embd=32, bias=False))
    ids = torch.tensor(tok.encode(corpus()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, len(ids) - BLOCK - 1, (8,), generator=gen)
        x = torch.stack([ids[i:i + BLOCK] for i in start])
        y = torch.stack([ids[i + 1:i + BLOCK + 1] for i in start])
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


def random_model() -> GPT:
    """A random GPT-2 BPE model whose blocks outweigh the embedding: with tied embeddings a plain random
    one echoes its input token, and a few hundred training steps at this vocabulary take minutes here.
    The padding rows past GPT-2's 50257 ids are zeroed (logit 0), as a trained model never picks them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=50304, n_layer=2, n_head=4, n_embd=32, bias=False))
    with torch.no_grad():
        model.transformer.wte.weight[GPT2_VOCAB:] = 0
        for block in model.transformer.h:
            block.attn.c_proj.weight.mul_(20)
            block.mlp.c_proj.weight.mul_(20)
            block.attn.c_attn.weight[:64].mul_(3)  # q and k rows: sharper attention
    return model.eval()


@pytest.fixture(scope="module", params=["char", "gpt2"])
def folder(request, tmp_path_factory):
    """(the exported model and tokenizer on our side, exported folder)."""
    if request.param == "char":
        tok = CharTokenizer.from_text(corpus())
        model = trained_model(tok, tok.vocab_size, 300)
    else:
        use_gpt2_bpe()
        tok = GPT2Tokenizer()
        model = random_model()
    path = tmp_path_factory.mktemp(f"hf-{request.param}")
    export.export(model, tok, path)
    return model, tok, path  # the folder holds exactly these: no id appended, no head row grown


def run_lm_eval(path, out):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "cache")}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={path}",
           "--tasks", "shakespeare_mc,shakespeare_gen", "--include_path", str(TASKS), "--output_path", str(out),
           "--log_samples", "--batch_size", "1"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    samples = {}
    for task in ("shakespeare_mc", "shakespeare_gen"):
        (file,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in file.read_text().splitlines()]
    return samples


@torch.no_grad()
def our_loglikelihood(model: GPT, tok, context: str, continuation: str) -> float:
    """Sum of log p(continuation | context), the continuation's ids cut from the whole text's ids as
    lm_eval cuts them (so a BPE merge across the boundary counts as it does there)."""
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    logp = torch.log_softmax(model(torch.tensor([whole]))[0][0].float(), dim=-1)  # (T, V)
    return sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole)))


@torch.no_grad()
def our_greedy(model: GPT, tok, context: str, max_new_tokens: int, until: str) -> str:
    ids = tok.encode(context)
    out = generate(model, torch.tensor([ids]), max_new_tokens, temperature=0)[0, len(ids):].tolist()
    if tok.eot_token is not None and tok.eot_token in out:
        out = out[:out.index(tok.eot_token)]
    return tok.decode(out).split(until)[0]


@pytest.mark.slow
def test_lm_eval_runs_both_task_kinds_and_agrees_with_us(folder, tmp_path):
    model, tok, path = folder
    samples = run_lm_eval(path, tmp_path)
    assert len(samples["shakespeare_mc"]) == len(MC) and len(samples["shakespeare_gen"]) == len(GEN)
    for sample, doc in zip(samples["shakespeare_mc"], MC):
        theirs = [float(r[0][0]) for r in sample["resps"]]
        ours = [our_loglikelihood(model, tok, doc["context"], c) for c in doc["choices"]]
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(theirs, ours)), (theirs, ours)
    generated = []
    for sample, doc in zip(samples["shakespeare_gen"], GEN):
        kwargs = sample["arguments"]["gen_args_0"]["arg_1"]
        ours = our_greedy(model, tok, doc["context"], kwargs["max_gen_toks"], kwargs["until"][0])
        assert sample["resps"][0][0] == ours
        generated.append(ours)
    assert len(set("".join(generated))) > 3, "every generation repeats one token: too weak a comparison"
