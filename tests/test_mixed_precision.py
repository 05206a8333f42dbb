"""Mixed precision on the CPU: bfloat16 autocast training, bfloat16 decoding through sample.py's inference
path, the float16 GradScaler, torch.compile training, and what the training step keeps in memory.

    python -m pytest tests/test_mixed_precision.py
    python -m pytest tests/test_mixed_precision.py -m "not slow"    # without the torch.compile run

--dtype=auto is bfloat16 on a CPU that computes it natively (cpu.cpu_native_bf16), float32 elsewhere;
the command line refuses float16 on the CPU, and bfloat16 where it is emulated. Most tests here build the
Runtime directly, so these code paths run on any CPU with its autocast and GradScaler; the one through
the scripts fakes the CPU's answer both ways.
"""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

import eval as eval_script
import sample
import train
from benchmarks import common
from core import cpu, kernels, runtime
from core.cpu import PackedLinear
from core.decoding import decode
from core.decoding.decode import generate, inference_model, keep_float32_head
from core.training import parallel
from core.weights.checkpoint import load_checkpoint
from model import GPT, CausalSelfAttention, GPTConfig, Kernels
from tests.helpers import TINY_TRAIN, char_data_fixture, one_thread, records, run_main, train_tiny

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60
BF16 = runtime.Runtime("cpu", "cpu", "bfloat16")
FP16 = runtime.Runtime("cpu", "cpu", "float16")


data_dir = char_data_fixture(TEXT)


@pytest.fixture(autouse=True)
def no_peak_measurement(monkeypatch):
    """train.py's CPU peak for MFU times matmuls in the run's dtype, seconds each where the CPU emulates half
    precision; no test here reads MFU (tests/test_runtime.py tests the measurement)."""
    monkeypatch.setattr(train.runtime, "cpu_matmul_peak_flops", lambda **kw: 1e12)


def run_train(rt, out_dir, data_dir, **overrides):
    """train.train with a directly built Runtime (train.main would refuse half precision on CPU)."""
    cfg = train.TrainConfig(**(TINY_TRAIN | dict(out_dir=str(out_dir), data_dir=str(data_dir)) | overrides))
    with one_thread():
        train.train(cfg, rt, runtime.StopFlag())


def test_bf16_autocast_training_step(tmp_path, data_dir, monkeypatch):
    """The forward runs in bfloat16 (the head's output is bf16), the weights and the checkpoint stay
    float32, and the loss falls."""
    seen = set()
    real_forward = GPT.forward

    def spy(self, *args, **kwargs):
        if self.training and not hasattr(self, "_spied"):
            self._spied = self.lm_head.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
        return real_forward(self, *args, **kwargs)
    monkeypatch.setattr(GPT, "forward", spy)
    run_train(BF16, tmp_path, data_dir, max_iters=30, lr_decay_iters=30, log_interval=1)
    assert seen == {torch.bfloat16}
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    state = load_checkpoint(tmp_path / "ckpt.pt")
    assert {t.dtype for t in state["model"].values()} == {torch.float32}


@pytest.mark.parametrize("native", [True, False])
def test_every_script_follows_the_cpus_bf16(tmp_path, data_dir, monkeypatch, native):
    """--dtype=auto through runtime.setup: where the CPU computes bf16 natively, train.py and eval.py run
    their forwards under bf16 autocast (every nn.Linear's output is bf16) with float32 weights and a
    float32 checkpoint, and sample.py decodes with its weights cast to bf16 (inference_model);
    elsewhere all three run float32 throughout."""
    monkeypatch.setattr(cpu, "cpu_native_bf16", lambda: native)
    dtype, want = ("bfloat16", torch.bfloat16) if native else ("float32", torch.float32)
    seen, linear = [], torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda m, x: seen.append((m.weight.dtype, linear(m, x).dtype))
                        or linear(m, x))
    train_tiny(tmp_path, data_dir, dtype="auto", max_iters=4, lr_decay_iters=4, eval_interval=4)
    assert set(seen) == {(torch.float32, want)}  # training forwards and train.py's own evaluation
    assert {t.dtype for t in load_checkpoint(tmp_path / "ckpt.pt")["model"].values()} == {torch.float32}
    assert f'"dtype": "{dtype}"' in (tmp_path / "config.json").read_text()
    seen.clear()
    result = run_main(eval_script.main, [f"--out_dir={tmp_path}", "--device=cpu"])
    assert result.returncode == 0 and f"cpu in {dtype}" in result.stderr and set(seen) == {(torch.float32, want)}
    seen.clear()  # the tiny model's matrices are too small to pack (PACK_MIN_WEIGHTS): all nn.Linear
    result = run_main(sample.main, [f"--out_dir={tmp_path}", "--device=cpu", "--num_samples=1", "--max_new_tokens=4"])
    assert result.returncode == 0 and f"cpu {dtype}" in result.stderr and set(seen) == {(want, want)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """A tiny model trained on TEXT (float32): its greedy text follows the lines, many different tokens."""
    out = tmp_path_factory.mktemp("trained")
    ckpt = train_tiny(out, data_dir, max_iters=150, lr_decay_iters=150, eval_interval=150)
    return load_checkpoint(ckpt)


# bfloat16 keeps 8 bits of mantissa: the trained model's logits come within a few hundredths of float32's
# under every kernel set, and the tolerance leaves room above the largest gap measured (docs/reliability.md#tests);
# a position whose float32 top two are further apart than twice it must pick the same top-1 in bfloat16.
BF16_LOGIT_TOL = 0.25


@torch.no_grad()
def teacher_forced_logits(model: GPT, idx: torch.Tensor, use_cache: bool) -> torch.Tensor:
    """The next-token logits generation reads (last_only) after each prefix of idx (B, T) -> (B, T, vocab):
    fed one token at a time through a KV cache, or each whole prefix without one."""
    cache = model.new_kv_cache(idx.size(0)) if use_cache else None
    steps = [model(idx[:, t:t + 1], kv_cache=cache, last_only=True)[0] if use_cache
             else model(idx[:, :t + 1], last_only=True)[0] for t in range(idx.size(1))]
    return torch.cat(steps, dim=1)


def test_bf16_decoding_through_sample_inference_path(trained):
    """inference_model casts the weights once to bfloat16; the KV cache is bfloat16, the next-token
    logits float32 (not rounded to bf16). Fed the same float32 context (the float32 model's own greedy
    text), bf16's next-token logits stay within BF16_LOGIT_TOL of float32's at every position and pick
    the same top-1 wherever float32's choice is clear of that; cached and uncached greedy decoding agree,
    past the context window too.

    Not compared: bf16's and float32's free-running greedy texts. Once one near-tie goes the other way
    the texts part for good, and where that happens depends on the CPU's kernels (74% equal positions
    under ATEN_CPU_CAPABILITY=avx2 here, 100% under default)."""
    from core.weights.checkpoint import model_from_checkpoint
    model = inference_model(model_from_checkpoint(trained), BF16)[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    assert model.new_kv_cache(2).k.dtype == torch.bfloat16
    stoi = trained["meta"]["tokenizer"]["stoi"]
    idx = torch.tensor([[stoi[c] for c in "First Cit"], [stoi[c] for c in "All: Spea"]])  # (2, 9)
    logits = model(idx, last_only=True)[0][:, -1, :]  # what generation reads for the next token
    assert logits.dtype == torch.float32 and logits.shape == (2, model.config.vocab_size)
    assert not torch.equal(logits, logits.bfloat16().float())  # finer than bfloat16's 8-bit mantissa
    # from the float32 head copied once (decode.Float32Head), not the bf16 head cast again per token: scaling the
    # copy moves them
    head = model.lm_head
    assert head.weight_t.dtype == torch.float32 and head.weight is model.transformer.wte.weight  # still tied
    assert torch.equal(head.weight_t, head.weight.float().t())  # (C, vocab), transposed once
    assert head.weight_t.is_contiguous()  # laid out (C, vocab): h @ weight_t reads it row after row
    with torch.no_grad():
        head.weight_t.mul_(2)
        assert torch.allclose(model(idx, last_only=True)[0][:, -1, :], 2 * logits)
        head.weight_t.div_(2)
    model.lm_head = torch.nn.Linear(*head.weight.shape[::-1], bias=False)  # without the copy: the bf16 head,
    model.lm_head.weight = head.weight  # cast to float32 again at each call, the same logits to 1e-5
    torch.testing.assert_close(model(idx, last_only=True)[0][:, -1, :], logits, rtol=1e-5, atol=1e-5)
    model.lm_head = head
    full = model(idx)[0]  # a whole sequence's logits read the bf16 head as nn.Linear does, not the float32 copy
    assert full.dtype == torch.bfloat16 and (full[:, -1].float() - logits).abs().max() < BF16_LOGIT_TOL

    reference = model_from_checkpoint(trained).eval()
    context = generate(reference, idx, model.config.block_size - idx.size(1), temperature=0.0)  # (2, 32)
    want = teacher_forced_logits(reference, context, use_cache=True)  # (2, 32, vocab)
    got = teacher_forced_logits(model, context, use_cache=True)
    error = (got - want).abs().max().item()
    assert 1e-3 < error < BF16_LOGIT_TOL, error  # bf16 was computed, and it is bf16's rounding, no more
    top2 = want.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * BF16_LOGIT_TOL
    assert clear.float().mean() > 0.75  # a trained model: most choices are clear (92% here)
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])

    cached = generate(model, idx, 60, temperature=0.0, use_cache=True, window_shift=8)
    uncached = generate(model, idx, 60, temperature=0.0, use_cache=False, window_shift=8)
    assert torch.equal(cached, uncached)
    assert all(len(set(row[9:].tolist())) > 8 for row in cached)  # real text, not one token repeated


def test_float32_decoding_reads_the_head_by_columns_with_the_same_floats(trained):
    """inference_model in float32 on a CPU lays the head's storage out (C, vocab) in place: the same
    values, the tied token table the same tensor (no second copy), logits equal to the row-major head's to
    1e-5, and greedy text the same."""
    from core.weights.checkpoint import model_from_checkpoint
    model = inference_model(model_from_checkpoint(trained), runtime.Runtime("cpu", "cpu", "float32"))[0]
    reference = model_from_checkpoint(trained).eval()
    head = model.lm_head.weight
    assert head.stride() == (1, head.size(0)) and type(model.lm_head) is torch.nn.Linear  # no float32 copy
    assert head.t().is_contiguous() and torch.equal(head, reference.lm_head.weight)
    if model.config.tie_embeddings:
        assert model.transformer.wte.weight is head
    stoi = trained["meta"]["tokenizer"]["stoi"]
    idx = torch.tensor([[stoi[c] for c in "First Cit"], [stoi[c] for c in "All: Spea"]])  # (2, 9)
    torch.testing.assert_close(model(idx, last_only=True)[0], reference(idx, last_only=True)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(model, idx, 40, temperature=0.0), generate(reference, idx, 40, temperature=0.0))


def test_next_logits_equal_the_full_forward_last_position(trained):
    from core.weights.checkpoint import model_from_checkpoint
    model = model_from_checkpoint(trained).eval()
    idx = torch.randint(model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)[0][:, -1, :]
        last, _ = model(idx, last_only=True)
    assert last.shape == (3, 1, model.config.vocab_size)
    torch.testing.assert_close(last[:, 0], full, rtol=1e-5, atol=1e-5)



def test_one_bf16_row_decodes_without_onednn_to_the_same_floats(trained, monkeypatch):
    """Batch 1 in bfloat16 (cpu.one_row_kernels): every Block's matmul runs with oneDNN off (torch's own
    GEMV, twice as fast at one row), and the logits are the very floats the oneDNN path gives, at every
    position of a cached greedy run. Two rows, or float32 weights, keep oneDNN; the flag is restored."""
    from core.weights.checkpoint import model_from_checkpoint
    model = inference_model(model_from_checkpoint(trained), BF16)[0]
    stoi = trained["meta"]["tokenizer"]["stoi"]
    idx = torch.tensor([[stoi[c] for c in "First Cit"]])  # (1, 9)
    context = generate(model, idx, model.config.block_size - idx.size(1), temperature=0.0)  # (1, 32)
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *_: seen.append(torch.backends.mkldnn.enabled))
    got = teacher_forced_logits(model, context, use_cache=True)  # (1, 32, vocab)
    assert seen == [False] * 32 and torch.backends.mkldnn.enabled
    seen.clear()
    with torch.no_grad():
        model(context.expand(2, -1)[:, :1], kv_cache=model.new_kv_cache(2), last_only=True)  # two rows
        fp32 = inference_model(model_from_checkpoint(trained), runtime.Runtime("cpu", "cpu", "float32"))[0]
        fp32.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *_: seen.append(torch.backends.mkldnn.enabled))
        fp32(context[:, :1], kv_cache=fp32.new_kv_cache(1), last_only=True)
    assert seen == [True, True]
    monkeypatch.setattr(cpu, "one_row_kernels", lambda x: contextlib.nullcontext())  # the oneDNN path
    assert torch.equal(got, teacher_forced_logits(model, context, use_cache=True))


@pytest.mark.skipif(not cpu.cpu_packs_bf16(), reason="decoding packs bfloat16 matrices for oneDNN only on an "
                    "x86 CPU with native bfloat16 (cpu.cpu_packs_bf16)")
def test_bf16_decoding_packs_the_blocks_matrices_to_the_same_floats(trained, monkeypatch):
    """On a CPU with native bfloat16, inference_model hands every Block's matrix of PACK_MIN_WEIGHTS
    weights or more to oneDNN once (cpu.pack_linears; the threshold lowered here to the MLP's matrices of the
    tiny model, so that both kinds are in it): those forwards run through cpu.PackedLinear, and the logits
    are the very floats of the unpacked model's, at every position of a cached greedy run at one row, and in a
    prefill of two rows. The parameter count is the unpacked model's."""
    from core.weights.checkpoint import model_from_checkpoint
    assert not any(isinstance(m, PackedLinear) for m in inference_model(model_from_checkpoint(trained),
                                                                                BF16)[0].modules())  # all small
    plain = model_from_checkpoint(trained).eval().bfloat16()
    keep_float32_head(plain)
    monkeypatch.setattr(cpu, "PACK_MIN_WEIGHTS", plain.transformer.h[0].mlp.c_fc.weight.numel())
    packed = inference_model(model_from_checkpoint(trained), BF16)[0]
    for block in packed.transformer.h:
        assert [isinstance(m, PackedLinear) for m in (block.mlp.c_fc, block.mlp.c_proj, block.attn.c_attn,
                                                     block.attn.c_proj)] == [True, True, False, False]
    assert packed.get_num_params() == plain.get_num_params()
    stoi = trained["meta"]["tokenizer"]["stoi"]
    idx = torch.tensor([[stoi[c] for c in "First Cit"]])  # (1, 9)
    context = generate(plain, idx, plain.config.block_size - idx.size(1), temperature=0.0)  # (1, 32)
    calls = []
    packed.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *_: calls.append(1))
    assert torch.equal(teacher_forced_logits(packed, context, use_cache=True),
                       teacher_forced_logits(plain, context, use_cache=True))
    assert len(calls) == 32
    two = torch.cat([context, context.flip(1)])  # (2, 32)
    with torch.no_grad():
        assert torch.equal(packed(two)[0], plain(two)[0])


def test_a_float32_servers_matrices_are_packed_and_one_row_reads_the_plain_ones(trained, monkeypatch):
    """A server's float32 model on an x86 CPU (inference_model(batched=True)) has every Block's matrix and the head
    packed for oneDNN (the threshold lowered to 0 for the tiny model), each keeping its plain weight: at one row the
    logits are the unpacked model's very floats at every position of a cached greedy run; at two rows they go
    through the packed matrices (one changed, they change) and agree with the plain model's to float32 rounding.
    Not packed without batched, on ARM, or under --compile."""
    from core.weights.checkpoint import model_from_checkpoint
    f32 = runtime.Runtime("cpu", "cpu", "float32")
    monkeypatch.setattr(cpu, "PACK_MIN_WEIGHTS", 0)
    plain = inference_model(model_from_checkpoint(trained), f32)[0]
    packed = inference_model(model_from_checkpoint(trained), f32, batched=True)[0]
    linears = [m for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    assert [type(m) for m in packed.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))] == \
        [PackedLinear] * len(linears) and isinstance(packed.lm_head, PackedLinear)
    assert packed.get_num_params() == plain.get_num_params()
    stoi = trained["meta"]["tokenizer"]["stoi"]
    idx = torch.tensor([[stoi[c] for c in "First Cit"]])  # (1, 9)
    context = generate(plain, idx, plain.config.block_size - idx.size(1), temperature=0.0)  # (1, 32)
    two = torch.cat([context, context.flip(1)])  # (2, 32)
    with torch.no_grad():
        assert torch.allclose(packed(two)[0], plain(two)[0], atol=1e-5)
        c_fc = packed.transformer.h[0].mlp.c_fc
        c_fc.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(c_fc.weight), cpu.PACK_ROWS)
        assert not torch.allclose(packed(two)[0], plain(two)[0], atol=1e-3)
    assert torch.equal(teacher_forced_logits(packed, context, use_cache=True),
                       teacher_forced_logits(plain, context, use_cache=True))  # one row: the plain weights
    model = model_from_checkpoint(trained)
    monkeypatch.setattr(model, "compile", lambda: None)  # the choice, not the compile
    assert not any(isinstance(m, PackedLinear) for m in inference_model(model, f32, True, batched=True)[0].modules())
    monkeypatch.setattr(decode.platform, "machine", lambda: "aarch64")
    assert not any(isinstance(m, PackedLinear) for m in inference_model(model_from_checkpoint(trained), f32,
                                                                        batched=True)[0].modules())


def test_bf16_decoding_packs_nothing_where_bf16_is_not_native(trained, monkeypatch):
    """Where the CPU has no native bfloat16, on ARM (never measured), under --compile, or in float32, the model
    keeps its nn.Linear matrices, however large (the threshold lowered to 0 here): oneDNN's bfloat16 products
    are emulated without native bf16, and torch.compile traces the plain model."""
    from core.weights.checkpoint import model_from_checkpoint

    def packed_any(model):
        return any(isinstance(m, PackedLinear) for m in model.modules())
    monkeypatch.setattr(cpu, "PACK_MIN_WEIGHTS", 0)
    monkeypatch.setattr(cpu, "cpu_native_bf16", lambda: True)
    model = model_from_checkpoint(trained)
    monkeypatch.setattr(model, "compile", lambda: None)  # the choice, not the compile
    assert not packed_any(inference_model(model, BF16, compile=True)[0])
    assert not packed_any(inference_model(model_from_checkpoint(trained), runtime.Runtime("cpu", "cpu",
                                                                                                   "float32"))[0])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")  # ARM with BF16
    assert not packed_any(inference_model(model_from_checkpoint(trained), BF16)[0])
    monkeypatch.setattr(cpu, "cpu_native_bf16", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not packed_any(inference_model(model_from_checkpoint(trained), BF16)[0])


def test_every_training_and_decoding_model_carries_the_cpus_kernel_choices():
    """The kernel choices (core/kernels.py's DeviceKernels: the short-attention math backend below, the one-row
    GEMV) act only where they are set from outside: parallelize sets them for every training run, inference_model
    for every decoding one, on the model and each attention; a bare GPT keeps torch's own choice."""
    def chosen(model):
        return {type(m.kernels) for m in model.modules() if isinstance(m, (GPT, CausalSelfAttention))}
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40)
    assert chosen(GPT(config)) == {Kernels}
    fp32 = runtime.Runtime("cpu", "cpu", "float32")
    assert chosen(parallel.parallelize(GPT(config), fp32, "ddp", activation_checkpointing=False, compile=False)) == \
        {kernels.DeviceKernels}
    assert chosen(inference_model(GPT(config), fp32)[0]) == {kernels.DeviceKernels}


def test_short_bf16_training_attention_takes_the_math_backend(monkeypatch):
    """bfloat16 attention that autograd records on the CPU over SHORT_TRAINING_MATH_KEYS keys or fewer
    in training mode (cpu.short_training_attention): SDPA's math backend, whose backward is the faster
    there; over more keys, without grad, in eval mode, or in float32, flash. Its gradients are as close to
    float64's as flash's are."""
    flash_on, real_sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        flash_on.append(torch.backends.cuda.flash_sdp_enabled())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    c = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=256, vocab_size=40)
    attn = CausalSelfAttention(c).train()
    attn.kernels = kernels.DeviceKernels()  # as kernels.choose_kernels sets it on a model that trains
    gen = torch.Generator().manual_seed(0)
    short, long = cpu.SHORT_TRAINING_MATH_KEYS, cpu.SHORT_TRAINING_MATH_KEYS + 1
    q, k, v = (3 * torch.randn(2, 2, long, 16, generator=gen) for _ in range(3))  # scores far from uniform

    def grads(dtype, T, kernel=attn._sdpa):
        leaves = [t[:, :, :T].to(dtype).requires_grad_() for t in (q, k, v)]
        kernel(*leaves).float().square().sum().backward()
        return [t.grad.double() for t in leaves]
    got = grads(torch.bfloat16, short)
    grads(torch.bfloat16, long)
    grads(torch.float32, short)
    with torch.no_grad():
        attn._sdpa(q[:, :, :short].bfloat16(), k[:, :, :short].bfloat16(), v[:, :, :short].bfloat16())
    grads(torch.bfloat16, short, attn.eval()._sdpa)  # evaluation, or inference with autograd on
    assert flash_on == [False, True, True, True, True] and torch.backends.cuda.flash_sdp_enabled()
    flash = grads(torch.bfloat16, short, lambda *t: real_sdpa(*t, is_causal=True))
    reference = grads(torch.float64, short, lambda *t: real_sdpa(*t, is_causal=True))
    for g, f, r in zip(got, flash, reference):
        scale = r.abs().max().item()
        assert (g - r).abs().max().item() <= 2 * (f - r).abs().max().item() + 1e-2 * scale


def test_fp16_grad_scaler_skips_an_inf_step_and_survives_resume(tmp_path, data_dir, monkeypatch):
    """float16 with torch.amp.GradScaler("cpu"): an inf gradient at iteration 3 (an overflow in the
    backward pass) skips that update and halves the scale; the loss itself is finite, so training goes
    on. The checkpoint holds the lowered scale, and a resumed run starts from it (not from 2**16)."""
    snapshots, calls = {}, {"n": 0, "before": None}
    real_unscale, real_update = torch.amp.GradScaler.unscale_, torch.amp.GradScaler.update

    def params(optimizer):
        return [p for g in optimizer.param_groups for p in g["params"]]

    def unscale_with_inf_at_3(scaler, optimizer):  # train.py's loop: unscale_, clip, step, update
        if calls["n"] == 3:
            params(optimizer)[0].grad.view(-1)[0] = float("inf")
        calls["before"] = (optimizer, [p.detach().clone() for p in params(optimizer)])
        real_unscale(scaler, optimizer)

    def update_and_record(scaler, *args):
        real_update(scaler, *args)
        optimizer, before = calls["before"]
        snapshots[calls["n"]] = (all(torch.equal(a, p) for a, p in zip(before, params(optimizer))), scaler.get_scale())
        calls["n"] += 1
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale_with_inf_at_3)
    monkeypatch.setattr(torch.amp.GradScaler, "update", update_and_record)
    assert FP16.grad_scaler().is_enabled()
    run_train(FP16, tmp_path, data_dir, max_iters=6, lr_decay_iters=10, grad_clip=1.0)
    assert snapshots[3] == (True, 2.0**15)  # skipped, scale halved from 2**16
    assert all(not unchanged for it, (unchanged, _) in snapshots.items() if it != 3)
    assert all(scale == 2.0**15 for it, (_, scale) in snapshots.items() if it > 3)
    saved = load_checkpoint(tmp_path / "ckpt.pt")["scaler"]
    assert saved["scale"] == 2.0**15 and saved["_growth_tracker"] == 2

    snapshots.clear()
    calls["n"] = -100  # no more infs
    run_train(FP16, tmp_path, data_dir, max_iters=8, lr_decay_iters=10, grad_clip=1.0, init_from="resume")
    assert [scale for _, scale in snapshots.values()] == [2.0**15, 2.0**15]
    assert load_checkpoint(tmp_path / "ckpt.pt")["scaler"]["_growth_tracker"] == 4


def test_training_step_does_not_hold_the_logits(tmp_path, data_dir, monkeypatch):
    """train.py's step keeps only the loss: the peak memory of a one-step run is below that of the same
    run whose forward also keeps the (B, T, vocab) logits alive through backward, by at least their size."""
    cfg = train.TrainConfig(**(TINY_TRAIN | dict(data_dir=str(data_dir), out_dir=str(tmp_path), batch_size=16,
                                                 vocab_size=4096, max_iters=1, eval_iters=1, overwrite=True)))
    rt, logits_bytes, forward, held = runtime.Runtime("cpu", "cpu", "float32"), 16 * 32 * 4096 * 4, GPT.forward, []

    def holding_forward(self, *args, **kwargs):
        logits, loss = forward(self, *args, **kwargs)
        if self.training:
            held[:] = [logits]  # alive until the next training forward: through this step's backward
        return logits, loss

    def run(hold: bool):
        with monkeypatch.context() as m:
            if hold:
                m.setattr(GPT, "forward", holding_forward)
            train.train(cfg, rt, runtime.StopFlag())
        held.clear()
    with one_thread():
        run(False), run(True)  # warm-up
        peaks = common.cpu_peak_extra_bytes({"holding": lambda: run(True), "train_py": lambda: run(False)})
    assert peaks["holding"] - peaks["train_py"] >= 0.9 * logits_bytes, peaks


@pytest.mark.slow
def test_compiled_training_on_cpu(tmp_path, data_dir):
    """torch.compile (inductor, CPU) trains the tiny model; the checkpoint is the plain module's."""
    ckpt = train_tiny(tmp_path, data_dir, compile=True, max_iters=4, log_interval=1, eval_interval=4)
    state = load_checkpoint(ckpt)
    assert not [k for k in state["model"] if "_orig_mod" in k]
    assert set(state["model"]) == set(GPT(GPTConfig(**state["meta"]["model_args"])).state_dict())
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


def test_sample_compile_warms_up_outside_the_timing_and_keeps_the_text(tmp_path, trained, monkeypatch):
    """sample.py --compile runs a short warm-up before its clock starts and says so; the warm-up draws
    from its own generator, so the sampled text equals the uncompiled run's. (torch.compile itself is
    replaced by a no-op here: compiling on the CPU takes minutes; the compiled CLI run is in test_gpu.py.)"""
    from core.training.checkpointing import save_checkpoint
    from tests.helpers import run_main
    save_checkpoint(tmp_path, trained["meta"], trained["model"])
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: None)
    argv = [f"--out_dir={tmp_path}", "--device=cpu", "--start=First", "--num_samples=2", "--max_new_tokens=30"]
    compiled, plain = (run_main(sample.main, argv + [f"--compile={c}"]) for c in (True, False))
    assert compiled.returncode == plain.returncode == 0, compiled.stderr
    assert "compiling took" in compiled.stderr and "not counted" in compiled.stderr
    assert "compiling" not in plain.stderr
    assert compiled.stdout == plain.stdout and "First" in plain.stdout


def test_attention_outside_training_on_cuda_runs_without_cudnn():
    """On a CUDA device (faked: only q's device is read) attention that autograd does not record runs with every
    SDPA backend but cuDNN's, whose per-shape plans cost decoding a build at every new key length
    (kernels.inference_attention); a recorded training forward, and any CPU call, keep torch's own choice."""
    cuda = torch.device("cuda")
    chosen = kernels.DeviceKernels()

    def backends(q, training):
        with chosen.attention(q, 10, training):
            return (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                    torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())

    everything = (True, True, True, True)
    assert backends(SimpleNamespace(device=cuda, requires_grad=False), training=False) == (False, True, True, True)
    assert backends(SimpleNamespace(device=cuda, requires_grad=True), training=False) == (False, True, True, True)
    with torch.no_grad():
        assert backends(SimpleNamespace(device=cuda, requires_grad=True), training=True) == (False, True, True, True)
    assert backends(SimpleNamespace(device=cuda, requires_grad=True), training=True) == everything
    assert backends(torch.zeros(1, 1, 1, 8), training=False) == everything


def test_every_attention_call_goes_through_the_kernels_hook(monkeypatch):
    """Prefill (causal), a chunk after cached tokens (the end-aligned mask) and one new token each reach SDPA inside
    Kernels.attention, so a choice made there (CUDA's decoding above) covers every decoding call."""
    inside, calls, real_sdpa = [False], [], torch.nn.functional.scaled_dot_product_attention

    class Spy(Kernels):
        @contextlib.contextmanager
        def attention(self, q, Tk, training):
            inside[0] = True
            yield
            inside[0] = False

    def sdpa(q, k, v, **kwargs):
        calls.append((q.size(2), k.size(2), inside[0]))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40)).eval()
    model.use_kernels(Spy())
    cache = model.new_kv_cache(1, 16)
    for T in (5, 3, 1):
        model(torch.zeros(1, T, dtype=torch.long), kv_cache=cache)
    assert calls == [(T, Tk, True) for T, Tk in ((5, 5), (3, 8), (1, 9)) for _ in range(2)]
