"""Whole-split perplexity and HellaSwag (core/evaluation/, eval.py, train.py's hellaswag_file).

    python -m pytest tests/test_evaluate.py

The model is a tiny one trained for a second or two on a repetitive text, so its predictions are
sharp and a wrong shift or a wrong window shows in the numbers. Independent figures come from
transformers' GPT2LMHeadModel on the same weights (through save_pretrained), one token at a time.
"""
import json
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import eval as eval_script
from core.evaluation import hellaswag, perplexity
from core.data.loader import TokenData
from core.data.tokenizer import CharTokenizer
from core.errors import UserError
from tests.helpers import (assert_user_error, make_char_dataset, make_gpt2_dataset, needs_transformers, records,
                           run_main, run_script, train_tiny, use_gpt2_bpe)

TEXT = "the cat sat on the mat. the dog ate the bone. a bird sang in the tree. " * 30
# Right endings follow their context in TEXT; the wrong ones are words of TEXT that never follow it there.
EXAMPLES = [
    ("the cat sat on the", ["bone.", "mat.", "tree.", "ate."], 1),
    ("the dog ate the", ["bone.", "mat.", "sang.", "the cat"], 0),
    ("a bird sang in the", ["mat.", "bone.", "cat.", "tree."], 3),
    ("the dog", ["sat on", "sang in", "ate the", "in the"], 2),
    ("a bird", ["ate the", "sang in", "sat on", "on the mat"], 1),
]
# A long right ending: the lowest loss per token (acc_norm), but a short wrong one has the lowest sum (acc).
LONG = ("the cat sat on the", ["mat. the dog ate the bone.", ".", "cat.", "dog."], 0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained tiny char model: (out_dir, data_dir, our GPT, the same weights in transformers)."""
    tmp = tmp_path_factory.mktemp("run")
    make_char_dataset(tmp / "data", TEXT, val_fraction=0.1)
    train_tiny(tmp / "out", tmp / "data", max_iters=120, lr_decay_iters=120, eval_interval=120)
    from core.weights.hf import to_transformers
    from core.weights.resolver import load_model
    model, tok, _ = load_model("resume", tmp / "out")
    to_transformers(model.eval()).save_pretrained(tmp / "hf")
    hf = needs_transformers().GPT2LMHeadModel.from_pretrained(tmp / "hf").eval()
    return tmp / "out", tmp / "data", model, tok, hf


def write_hellaswag(path, examples, extra_lines=()):
    lines = [json.dumps({"ind": i, "ctx": c, "endings": e, "label": label, "activity_label": "test"})
             for i, (c, e, label) in enumerate(examples)]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n")
    return path


def hf_token_loss(hf, context: list[int], target: int) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([context])).logits[0, -1]
    return F.cross_entropy(logits, torch.tensor(target)).item()


# -----------------------------------------------------------------------------
# perplexity


@pytest.mark.parametrize("n,T,stride", [(10, 4, 4), (10, 4, 1), (11, 4, 3), (5, 4, 4), (4, 8, 8), (40, 8, 5)])
def test_windows_score_every_token_once_with_enough_context(n, T, stride):
    scored = []
    for begin, end, new in perplexity.split_windows(n, T, stride):
        assert 0 < end - begin <= T and 0 < new <= end - begin
        for j in range(end - new + 1, end + 1):  # target token j, predicted from tokens[begin:j]
            assert j - begin >= min(j, T - stride + 1)
            scored.append(j)
    assert scored == list(range(1, n))


def test_perplexity_equals_a_per_token_computation_in_transformers(run):
    """Each token j once, from the context its window gives it: tokens[k*stride : j] with k the first
    window whose targets reach j (k = ceil((j - T) / stride), at least 0)."""
    _, data_dir, model, _, hf = run
    T = 16
    data = TokenData(data_dir, "val", T)
    tokens = torch.from_numpy(np.fromfile(data.paths[0], dtype=data.dtype).astype(np.int64))
    n = len(tokens)
    for stride in (T, 5, 1):
        ours = perplexity.evaluate_split(model, data, stride=stride, batch_size=3)
        losses = []
        for j in range(1, n):
            k = max(0, math.ceil((j - T) / stride))
            losses.append(hf_token_loss(hf, tokens[k * stride:j].tolist(), int(tokens[j])))
        assert ours.tokens == n - 1
        assert ours.loss == pytest.approx(sum(losses) / len(losses), abs=1e-5)
        assert ours.perplexity == pytest.approx(math.exp(ours.loss))
    assert ours.loss < 1.0  # the model has learned the text: a wrong target or context would show


def test_eval_command_reports_loss_perplexity_and_tokens(run):
    out_dir, data_dir, model, _, _ = run
    expected = perplexity.evaluate_split(model, TokenData(data_dir, "val", 32), stride=8)
    # float32 as `expected` is: --dtype=auto is bf16 autocast on a CPU with native bf16
    result = run_main(eval_script.main, [f"--out_dir={out_dir}", "--device=cpu", "--dtype=float32", "--stride=8"])
    assert result.returncode == 0, result.stderr
    n = TokenData(data_dir, "val", 32).num_tokens
    assert result.stdout.strip() == (f"{data_dir} val: loss {expected.loss:.4f} | perplexity {expected.perplexity:.3f}"
                                     f" | bits/byte {expected.loss / math.log(2):.4f} | {n - 1:,} tokens, {n - 1:,} bytes"
                                     f" (block_size 32, stride 8)")  # ASCII characters: one byte per token


MIXED = ("中文測試，日本語のテキスト。한국어 😀👍🏽👩‍💻\n\t\t  indented\r\n\r\nnbsp\u00a0here\u200bzero\u200dwidth"
         "   \n\n\n  trailing  \n def f(x):\n    return 1234567 + x  # ünïcödé\n")


def test_token_bytes_add_up_to_the_text(tmp_path):
    """Every tokenizer's ids of a text hold exactly its UTF-8 bytes; special tokens hold none."""
    use_gpt2_bpe()
    from core.data.hf_tokenizer import load_hf_tokenizer, save_hf_tokenizer
    from core.data.tokenizer import EOT, GPT2Tokenizer, token_bytes, train_bpe

    bpe = train_bpe(iter([MIXED * 3, TEXT]), 400, (EOT, "<|user|>"), progress=False)
    save_hf_tokenizer(bpe, tmp_path, 64)
    for tok in (GPT2Tokenizer(), bpe, load_hf_tokenizer(tmp_path), CharTokenizer.from_text(MIXED)):
        counts = token_bytes(tok)
        assert len(counts) == tok.vocab_size
        assert sum(counts[i] for i in tok.encode(MIXED)) == len(MIXED.encode("utf-8")), type(tok).__name__
        assert counts[tok.eot_token] == 0 if tok.eot_token is not None else True
    assert token_bytes(bpe)[bpe.backend.token_to_id("<|user|>")] == 0


def test_bits_per_byte_is_the_loss_in_bits_over_the_bytes_scored(tmp_path):
    """A BPE dataset of multi-byte text: bits per byte = summed loss / ln 2 / the bytes of the decoded targets."""
    import importlib.util

    from core.weights.resolver import load_model
    from core.data.tokenizer import token_bytes
    from tests.helpers import REPO_ROOT

    for name in ("a", "b"):  # two documents: the val split is one whole document, starting with ASCII
        (tmp_path / f"{name}.txt").write_text(f"document {name}: " + MIXED * 20, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("prepare_text", REPO_ROOT / "data" / "text" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([f"--input={tmp_path / '?.txt'}", "--tokenizer=bpe:300", f"--out_dir={tmp_path / 'data'}",
                 "--val_fraction=0.5"])
    train_tiny(tmp_path / "out", tmp_path / "data", max_iters=30, lr_decay_iters=30, eval_interval=30)
    model, tok, _ = load_model("resume", tmp_path / "out")
    data = TokenData(tmp_path / "data", "val", 32)
    r = perplexity.evaluate_split(model, data, stride=16, token_bytes=token_bytes(tok))
    ids = np.fromfile(tmp_path / "data" / "val.bin", dtype=np.uint16).tolist()
    assert tok.eot_token not in ids  # one document: nothing special to leave out
    scored_text = tok.decode(ids[1:])
    assert r.bytes == len(scored_text.encode("utf-8")) > r.tokens  # multi-byte text: more bytes than tokens
    assert r.bpb == pytest.approx(r.loss * r.tokens / math.log(2) / r.bytes, rel=1e-9)
    line = run_main(eval_script.main, [f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--dtype=float32",
                                       "--stride=16"]).stdout
    assert f"| bits/byte {r.bpb:.4f} | {r.tokens:,} tokens, {r.bytes:,} bytes" in line


def test_bad_perplexity_input_is_one_line(run, tmp_path):
    out_dir, data_dir, _, _, _ = run
    make_char_dataset(tmp_path / "short", TEXT, val_fraction=0.005)  # 10 val tokens < block_size + 1
    make_char_dataset(tmp_path / "other", "ABCDEFGHIJKLMNOPQRSTUVWXYZ .," * 30)  # another vocabulary
    common = [f"--out_dir={out_dir}", "--device=cpu"]
    cases = [
        ([f"--data_dir={tmp_path / 'missing'}"], "meta.json not found"),
        ([f"--data_dir={tmp_path / 'short'}"], "fewer than block_size + 1"),
        ([f"--data_dir={tmp_path / 'other'}"], "tokenizer"),
        ([f"--data_dir={data_dir}", "--stride=33"], "stride 33 is larger than block_size 32"),
        ([f"--data_dir={data_dir}", "--block_size=64"], "larger than the model's 32"),
        (["--task=mmlu"], "task must be one of"),
    ]
    for args, fragment in cases:
        assert_user_error(run_main(eval_script.main, common + args), fragment)
    assert_user_error(run_main(eval_script.main, [f"--out_dir={tmp_path}", "--device=cpu"]), "no checkpoint")


def test_gpt2_weights_on_a_bpe_split(tmp_path):
    """eval.py --init_from=<save_pretrained dir> with GPT-2's BPE; a char dataset is refused."""
    use_gpt2_bpe()
    transformers = needs_transformers()
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32)).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    make_gpt2_dataset(tmp_path / "bpe", ["Hello world, this is a small test document for perplexity."] * 8)
    make_char_dataset(tmp_path / "char", TEXT)
    ok = run_main(eval_script.main, [f"--init_from={tmp_path / 'gpt2'}", f"--data_dir={tmp_path / 'bpe'}",
                                     "--device=cpu"])
    assert ok.returncode == 0, ok.stderr
    n = TokenData(tmp_path / "bpe", "val", 32).num_tokens
    assert f"| {n - 1:,} tokens, " in ok.stdout and "(block_size 32, stride 32)" in ok.stdout
    loss = float(ok.stdout.split("loss ")[1].split()[0])
    assert abs(loss - math.log(50257)) < 0.5  # random weights: near-uniform over GPT-2's vocabulary
    bad = run_main(eval_script.main, [f"--init_from={tmp_path / 'gpt2'}", f"--data_dir={tmp_path / 'char'}",
                                      "--device=cpu"])
    assert_user_error(bad, "tokenizer 'char'")


# -----------------------------------------------------------------------------
# HellaSwag


def test_hellaswag_scores_equal_transformers(run, tmp_path):
    """Summed and mean loss of each ending's tokens, after context + " " + ending, as GPT2LMHeadModel gives them."""
    _, _, model, tok, hf = run
    examples = hellaswag.load_hellaswag(write_hellaswag(tmp_path / "hs.jsonl", EXAMPLES + [LONG]))
    right, right_norm = 0, 0
    for ex, (tokens, mask, label) in zip(examples, hellaswag.render_examples(examples, tok, 32)):
        total, mean = hellaswag.ending_losses(model, tokens, mask)
        ctx = tok.encode(ex.context)
        expected = []
        for i, ending in enumerate(ex.endings):
            end = tok.encode(" " + ending)
            ids = (ctx + end)[-32:]  # LONG is longer than the context: its first tokens are dropped
            assert tokens[i, :len(ids)].tolist() == ids
            losses = [hf_token_loss(hf, ids[:j], ids[j]) for j in range(len(ids) - len(end), len(ids))]
            expected.append((sum(losses), sum(losses) / len(losses)))
        torch.testing.assert_close(total, torch.tensor([e[0] for e in expected]), atol=1e-4, rtol=0)
        torch.testing.assert_close(mean, torch.tensor([e[1] for e in expected]), atol=1e-5, rtol=0)
        right += min(range(4), key=lambda i: expected[i][0]) == label
        right_norm += min(range(4), key=lambda i: expected[i][1]) == label
    assert (right, right_norm) == (5, 6)  # the sum and the mean disagree on LONG
    scores = hellaswag.evaluate_hellaswag(model, hellaswag.render_examples(examples, tok, 32))
    assert scores == {"acc": 5 / 6, "acc_norm": 1.0, "examples": 6}


def test_hellaswag_picks_the_endings_the_model_has_seen(run, tmp_path):
    out_dir, _, _, _, _ = run
    path = write_hellaswag(tmp_path / "hs.jsonl", EXAMPLES)
    result = run_main(eval_script.main, [f"--out_dir={out_dir}", "--task=hellaswag", f"--hellaswag_file={path}",
                                         "--device=cpu"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hellaswag {path}: acc 1.0000 | acc_norm 1.0000 | 5 examples"
    swapped = [(c, e, (label + 1) % 4) for c, e, label in EXAMPLES]  # every label now names a wrong ending
    result = run_main(eval_script.main, [f"--out_dir={out_dir}", "--task=hellaswag", "--device=cpu",
                                         f"--hellaswag_file={write_hellaswag(tmp_path / 'bad.jsonl', swapped)}"])
    assert "acc 0.0000 | acc_norm 0.0000 | 5 examples" in result.stdout


def test_bad_hellaswag_input_is_one_line(run, tmp_path):
    out_dir, _, _, _, _ = run
    good = json.dumps({"ctx": "the cat", "endings": ["sat", "mat", "a", "b"], "label": 0})
    cases = [
        (["{not json"], "line 2 is not valid JSON"),
        ([json.dumps({"ctx": "the cat", "endings": ["a", "b", "c"], "label": 0})], "line 2: 'endings' must be"),
        ([json.dumps({"ctx": "the cat", "endings": ["a", "b", "c", "d"], "label": 4})], "line 2: 'label' must be"),
        ([json.dumps({"ctx": "", "endings": ["a", "b", "c", "d"], "label": 0})], "line 2 has no non-empty"),
        ([json.dumps({"ctx": "QUERY", "endings": ["a", "b", "c", "d"], "label": 0})],
         "HellaSwag line 2 cannot be encoded with the model's tokenizer"),
    ]
    for i, (lines, fragment) in enumerate(cases):
        path = tmp_path / f"case{i}.jsonl"
        path.write_text("\n".join([good, *lines]) + "\n")
        result = run_main(eval_script.main, [f"--out_dir={out_dir}", "--task=hellaswag", f"--hellaswag_file={path}",
                                             "--device=cpu"])
        assert_user_error(result, fragment)
    missing = run_main(eval_script.main, [f"--out_dir={out_dir}", "--task=hellaswag", "--device=cpu",
                                          f"--hellaswag_file={tmp_path / 'none.jsonl'}"])
    assert_user_error(missing, "not found; run python data/hellaswag/prepare.py")
    with pytest.raises(UserError, match="line 1: an ending of 32 tokens leaves no context"):  # as many as block_size
        hellaswag.render_examples([hellaswag.HellaSwagExample(1, "the", ["a" * 31, "b", "c", "d"], 0)],
                                 CharTokenizer.from_text(TEXT + "b"), 32)


def test_prepare_checks_every_line_and_writes_the_file(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("hellaswag_prepare", "data/hellaswag/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    source = write_hellaswag(tmp_path / "source.jsonl", EXAMPLES)
    out = prepare.main([f"--input={source}", f"--out_dir={tmp_path / 'out'}"])
    assert out.read_bytes() == source.read_bytes() and len(hellaswag.load_hellaswag(out)) == 5
    broken = write_hellaswag(tmp_path / "broken.jsonl", EXAMPLES, extra_lines=['{"ctx": "x"'])
    assert_user_error(run_main(prepare.main, [f"--input={broken}", f"--out_dir={tmp_path / 'out2'}"]),
                      "broken.jsonl line 6 is not valid JSON")
    assert not (tmp_path / "out2" / "hellaswag_val.jsonl").exists()
    assert_user_error(run_main(prepare.main, [f"--input={tmp_path / 'none'}"]), "cannot be read")


def test_hellaswag_inside_training_is_logged(run, tmp_path):
    _, data_dir, _, _, _ = run
    path = write_hellaswag(tmp_path / "hs.jsonl", EXAMPLES)
    train_tiny(tmp_path / "out", data_dir, max_iters=120, lr_decay_iters=120, eval_interval=60,
               hellaswag_file=str(path))
    evals = [r for r in records(tmp_path / "out") if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 60, 120]
    assert all(0.0 <= r["hellaswag_acc"] <= 1.0 and 0.0 <= r["hellaswag_acc_norm"] <= 1.0 for r in evals)
    assert evals[-1]["hellaswag_acc_norm"] == 1.0  # the same training as the fixture's model, which gets all 5


def test_ranks_split_the_work_between_them(run, tmp_path, monkeypatch):
    """Each rank's share, summed as the all-reduce would, equals one process's figures (in-process: the
    collective is replaced by a no-op, and the sums are added here)."""
    _, data_dir, model, tok, _ = run
    monkeypatch.setattr(perplexity.dist, "all_reduce", lambda t: None)
    data = TokenData(data_dir, "val", 16)
    whole = perplexity.evaluate_split(model, data, stride=5, batch_size=2)
    parts = [perplexity.evaluate_split(model, data, stride=5, batch_size=2, rank=r, world_size=3) for r in range(3)]
    assert sum(p.tokens for p in parts) == whole.tokens
    assert sum(p.loss * p.tokens for p in parts) == pytest.approx(whole.loss * whole.tokens, rel=1e-9)
    rendered = hellaswag.render_examples(hellaswag.load_hellaswag(write_hellaswag(tmp_path / "hs.jsonl", EXAMPLES)),
                                         tok, 32)
    swapped = [(t, m, (label + (i % 2)) % 4) for i, (t, m, label) in enumerate(rendered)]  # 3 right, 2 wrong
    model.train()  # as inside training: evaluating must hand it back in training mode
    parts = [hellaswag.evaluate_hellaswag(model, swapped, rank=r, world_size=2) for r in range(2)]
    assert model.training
    model.eval()
    assert [p["examples"] for p in parts] == [3, 2]  # rank 1 scored a spare 3rd example and did not count it
    assert sum(p["acc"] * p["examples"] for p in parts) == 3


def test_evaluation_runs_in_eval_mode_without_gradients(run, tmp_path):
    """No dropout and no autograd graph while scoring, whatever mode the model came in (training's evals)."""
    _, data_dir, model, tok, _ = run
    seen = []
    hook = model.register_forward_hook(lambda module, *_: seen.append((module.training, torch.is_grad_enabled())))
    model.train()
    try:
        perplexity.evaluate_split(model, TokenData(data_dir, "val", 16), batch_size=4)
        examples = hellaswag.load_hellaswag(write_hellaswag(tmp_path / "hs.jsonl", EXAMPLES))
        hellaswag.evaluate_hellaswag(model, hellaswag.render_examples(examples, tok, 32))
        assert model.training
    finally:
        hook.remove()
        model.eval()
    assert len(seen) > len(EXAMPLES) and set(seen) == {(False, False)}


@pytest.mark.slow
def test_hellaswag_under_torchrun_agrees_with_one_process(run, tmp_path):
    """torchrun, 2 CPU processes over gloo: 5 examples split 3 + 2, counts all-reduced, printed once."""
    out_dir, _, _, _, _ = run
    args = [f"--out_dir={out_dir}", "--device=cpu", "--task=hellaswag",
            f"--hellaswag_file={write_hellaswag(tmp_path / 'hs.jsonl', EXAMPLES[:4] + [EXAMPLES[0][:2] + (3,)])}"]
    result = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "eval.py", *args,
                        timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == run_main(eval_script.main, args).stdout.strip()
    assert result.stdout.strip().endswith("acc 0.8000 | acc_norm 0.8000 | 5 examples")
