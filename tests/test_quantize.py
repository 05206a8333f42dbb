"""core/decoding/quantize.py: int8 and int4 matmuls against the float product within the error their scales
allow, greedy text of a trained model under int8 equal to float32's, the refusals, and sample.py and eval.py
with --quantize (serve.py's engine: tests/test_serve.py).

    python -m pytest tests/test_quantize.py
"""
import pytest
import torch
import torch.nn as nn

import eval as eval_script
import sample
from core import runtime
from core.decoding import quantize as Q
from core.decoding.decode import Sampling, generate, inference_model
from core.errors import UserError
from core.weights.resolver import load_model
from tests.helpers import ROMEO_JULIET, assert_user_error, make_char_dataset, one_thread, run_main, train_tiny

FLOAT32 = runtime.Runtime("cpu", "cpu", "float32")
QUANTIZE = Q.quantize
GREEDY_AGREE = 200  # tokens of greedy text int8 and float32 give alike on the trained model here (measured: 300 of 300)


def uneven_linear(out_features: int, in_features: int, group: int = 32) -> nn.Linear:
    """A linear layer whose rows span four orders of magnitude, and whose input groups of `group` columns do too:
    one scale for all rows (or per column, or per row where groups are due) rounds the small weights to 0."""
    torch.manual_seed(0)
    rows = torch.logspace(-3, 1, out_features)[torch.randperm(out_features)]  # (out,)
    groups = torch.logspace(-2, 0, in_features // group)[torch.randperm(in_features // group)]  # (in / group,)
    lin = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features) * rows[:, None] * groups.repeat_interleave(group))
    return lin


def error_bound(x: torch.Tensor, w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """int4's: the most |x @ w_q.T - x @ w.T| may be, (M, out), when each weight w[n, k] is off by at most
    step[n, k] / 2: sum_k |x[m, k]| * step[n, k] / 2, the scale itself rounded to bfloat16 (relative 2^-8 to be
    safe), plus x rounded to bfloat16 (each |x[m, k] w[n, k]| off by 2^-9 of itself) and the bfloat16 output
    (2^-9 of |y|)."""
    quantization = x.abs() @ (step / 2 * (1 + 2 ** -7)).T
    inputs = 2 ** -8 * (x.abs() @ w.abs().T)
    return quantization + inputs + 2 ** -8 * (x @ w.T).abs()


def int8_error_bound(x: torch.Tensor, w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """int8's, (M, out): each weight off by at most step[n, k] / 2 and each input by half of x_step, the 7-bit
    step over the whole input's range with zero in it, (max(x, 0) - min(x, 0)) / 127. So |x_q w_q - x w| is at
    most |x| step / 2 + x_step / 2 (|w| + step / 2), summed over k; plus float32 rounding (2^-20 of the sums)."""
    x_step = (x.max().clamp(min=0) - x.min().clamp(max=0)) / 127
    bound = x.abs() @ (step / 2).T + x_step / 2 * (w.abs() + step / 2).sum(1)
    return bound * (1 + 2 ** -10) + 2 ** -20 * (x.abs() @ w.abs().T)


def int8_step(w):  # (out, in): one step per row, max |w| / 127
    return (w.abs().amax(dim=1, keepdim=True) / 127).expand_as(w)


def int4_step(w, group):  # (out, in): one step per row and group, (max - min) / 15
    wg = w.view(w.size(0), -1, group)
    return ((wg.amax(-1) - wg.amin(-1)) / 15).repeat_interleave(group, dim=1)


@pytest.mark.parametrize("kind, shape", [("int8", (128, 128)), ("int8", (80, 40)), ("int4", (128, 128)),
                                         ("int4", (65, 64))])  # 65: a head padded to 16 rows and sliced
def test_quantized_matmul_is_within_the_error_its_scales_allow(kind, shape):
    lin = uneven_linear(*shape, group=Q.INT4_GROUP_SIZE if kind == "int4" else 8)
    w = lin.weight.detach()
    lin.bias = nn.Parameter(torch.randn(shape[0]))  # int8 adds it inside FBGEMM's product
    x = torch.randn(3, shape[1])
    y = Q.QuantizedLinear(lin, kind)(x) - lin.bias.detach()
    assert y.dtype == torch.float32 and y.shape == (3, shape[0])
    if kind == "int8":
        bound = int8_error_bound(x, w, int8_step(w))
    else:
        bound = error_bound(x, w, int4_step(w, Q.INT4_GROUP_SIZE))
    err = (y - x @ w.T).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max():.3g}; rows {(err > bound).any(0).nonzero()[:5].tolist()}"
    assert err.max() > 0  # quantized: not the float product by another road


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_small_rows_keep_their_digits(kind):
    """Row by row the relative error stays small, even for rows 10^4 times smaller than the largest and input
    groups 100 times smaller than others: what one scale for all rows (or per column, or per row for int4) would
    wipe out. The worst-case bound above is too loose for that (it sums every error's size, where they mostly
    cancel); measured here: at most 1.9% of a row for int8, 11% for int4 (three seeds), against 100% for a row rounded to 0."""
    lin = uneven_linear(64, 128)
    x = torch.randn(256, 128)  # many inputs: each row's relative error is then a stable figure
    y, ref = Q.QuantizedLinear(lin, kind)(x), x @ lin.weight.detach().T
    rel = (y - ref).norm(dim=0) / ref.norm(dim=0)  # (out,)
    assert float(rel.max()) < (0.03 if kind == "int8" else 0.15), rel.max()


def test_int8_rows_are_rounded_each_on_its_own_range():
    """A row's int8 result is the same alone and in a batch, whatever its batchmates' range: rows 1,000 times
    apart in size, a zero row, one-signed rows. One range for the batch (FBGEMM's own for several rows) rounds the
    small rows' activations to a few levels; measured: 4e-7 of the largest output between alone and batched."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 80)
    q = Q.QuantizedLinear(lin, "int8")
    x = torch.randn(12, 96) * torch.logspace(-2, 1, 12)[:, None]  # (12, 96)
    x[3], x[5], x[6] = 0, x[5].abs(), -x[6].abs()
    alone = torch.cat([q(row[None]) for row in x])  # (12, 80): one row per call, FBGEMM's own rounding
    batched = q(x)
    assert float((alone - batched).abs().max()) < 1e-6 * float(alone.abs().max())
    assert torch.equal(q(x[:5]), batched[:5])  # rows beside it change nothing, bit for bit
    ref = lin(x).detach()
    assert float(((batched - ref).norm(dim=1) / ref.norm(dim=1)).max()) < 0.05  # the smallest rows keep their digits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A char model trained on a Shakespeare passage (widths multiples of int4's group), its out_dir and data_dir."""
    root = tmp_path_factory.mktemp("quantize")
    make_char_dataset(root / "data", ROMEO_JULIET)
    train_tiny(root / "out", root / "data", block_size=64, n_layer=2, n_head=2, n_embd=64, batch_size=16,
               max_iters=500, lr_decay_iters=500, learning_rate=3e-3, min_lr=3e-4, eval_interval=500, log_interval=250)
    return root / "out", root / "data"


def greedy(model, prompt, n):
    with one_thread():
        return generate(model, torch.tensor([prompt]), n, Sampling(temperature=0))[0, len(prompt):].tolist()


def loaded(out_dir, kind):
    model, tok, _ = load_model("resume", str(out_dir))
    return inference_model(model, FLOAT32, quantize=kind)[0], tok


def test_int8_greedy_text_equals_float32s(trained):
    (f32, tok), (i8, _) = loaded(trained[0], "none"), loaded(trained[0], "int8")
    prompt = tok.encode("ROMEO:")
    want = greedy(f32, prompt, GREEDY_AGREE)
    assert len(set(want)) > 10  # real text
    assert greedy(i8, prompt, GREEDY_AGREE) == want
    assert isinstance(i8.lm_head, Q.QuantizedLinear) and isinstance(i8.transformer.h[0].mlp.c_fc, Q.QuantizedLinear)
    assert isinstance(i8.transformer.wte, nn.Embedding) and i8.transformer.wte.weight.dtype == torch.float32
    assert i8.get_num_params() == f32.get_num_params()  # the tied head counted once, as the float model's


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_stays_the_float_models(kind, tied):
    """Every matrix swapped for one whose weights parameters() no longer shows (int8's bias folded in too):
    GPT.get_num_params still counts them, a tied head once (as the token table), an untied head whole."""
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=65, tie_embeddings=tied)).eval()
    floats = model.get_num_params()
    assert Q.quantize(model, kind).get_num_params() == floats
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_sample_py_quantize_decodes_the_quantized_model(trained, kind, monkeypatch):
    """sample.py --quantize=KIND prints the quantized model's greedy text, from a model quantized once, to KIND."""
    out_dir, n = trained[0], 100
    q, tok = loaded(out_dir, kind)
    prompt = tok.encode("JULIET:")
    calls = []
    monkeypatch.setattr(Q, "quantize", lambda model, k: calls.append(k) or QUANTIZE(model, k))
    r = run_main(sample.main, ["--device=cpu", "--dtype=float32", f"--out_dir={out_dir}", "--start=JULIET:",
                               "--num_samples=1", f"--max_new_tokens={n}", "--temperature=0", f"--quantize={kind}"])
    assert r.returncode == 0, r.stderr
    assert calls == [kind] and f"{kind} weights" in r.stderr
    assert r.stdout.split("\n---------------\n")[0] == tok.decode(prompt + greedy(q, prompt, n))


def test_eval_py_reports_each_kinds_perplexity(trained):
    out_dir, data_dir = trained
    losses = {}
    for kind in Q.KINDS:
        r = run_main(eval_script.main, ["--device=cpu", "--dtype=float32", f"--out_dir={out_dir}",
                                        f"--data_dir={data_dir}", f"--quantize={kind}"])
        assert r.returncode == 0, r.stderr
        losses[kind] = float(r.stdout.split("loss ")[1].split()[0])
        assert "bits/byte" in r.stdout
    assert losses["none"] != losses["int8"] != losses["int4"]  # each evaluated its own weights
    assert abs(losses["int8"] - losses["none"]) < 0.005  # nats: this model's loss is near 0, a ratio would be noise
    assert abs(losses["int4"] - losses["none"]) < 0.1 * losses["none"]


def test_refusals_are_one_line(trained):
    with pytest.raises(UserError, match="one of none, int8, int4"):
        Q.check_quantize("int3")
    with pytest.raises(UserError, match="decoding only"):
        Q.quantize(load_model("resume", str(trained[0]))[0].train(), "int8")
    with pytest.raises(UserError, match="--device=cpu"):
        Q.check_quantize("int8", device="cuda")
    Q.check_quantize("none", training=True, device="cuda")  # nothing to refuse
    for main in (sample.main, eval_script.main):
        assert_user_error(run_main(main, ["--device=cpu", f"--out_dir={trained[0]}", "--quantize=int3"]),
                          "--quantize must be one of")


def test_a_width_the_kernels_cannot_take_is_refused():
    with pytest.raises(UserError, match=f"multiple of {Q.INT4_GROUP_SIZE}"):
        Q.QuantizedLinear(nn.Linear(48, 32), "int4")


def test_a_quantized_head_refuses_to_grow():
    """An old character run is served with <|endoftext|> appended (resolver.with_end_of_text grows the head by a
    row): serve.py grows it before quantizing, and grow_vocab on a quantized head says so rather than leaving a
    head one row short (benchmarks' serve section with --serve_quantize caught that)."""
    from model import GPT, GPTConfig

    model = Q.quantize(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=65)).eval(), "int8")
    with pytest.raises(ValueError, match="not a QuantizedLinear: grow the vocabulary before"):
        model.grow_vocab(66)
