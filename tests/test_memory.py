"""Memory: the training-memory estimate, refusing a run that plainly does not fit, and out-of-memory
as one line at build and at the first step.

    python -m pytest tests/test_memory.py
"""
import pytest
import torch

import train
from benchmarks import common, memory as bench_memory
from core.fileio import format_bytes
from core.training import memory
from core.weights import resolver
from model import GPT, GPT2_SHAPES, GPTConfig
from tests.helpers import assert_user_error, char_data_fixture, cli_args, run_main, run_scripts

GPT2_SMALL_PARAMS = 124_439_808  # vocab 50257, bias, tied head (GPT-2's published count)
TEXT = "To be, or not to be, that is the question.\n" * 40


data_dir = char_data_fixture(TEXT)


def test_weights_grads_and_optimizer_of_gpt2_small():
    est = memory.estimate_training_memory(GPTConfig(vocab_size=50257), batch_size=1, seq_len=1)
    assert est.params == est.grads == GPT2_SMALL_PARAMS * 4
    assert est.optimizer == GPT2_SMALL_PARAMS * 8  # AdamW: two fp32 moments
    bf16 = memory.estimate_training_memory(GPTConfig(vocab_size=50257), 1, param_dtype=torch.bfloat16, seq_len=1)
    assert bf16.params == GPT2_SMALL_PARAMS * 2 and bf16.optimizer == est.optimizer
    # Muon: one momentum for the 48 block matrices (12 layers x 4 of 768-wide shapes), AdamW's two for the rest.
    muon = memory.estimate_training_memory(GPTConfig(vocab_size=50257), 1, "muon", seq_len=1)
    block_matrices = 12 * (768 * 2304 + 768 * 768 + 768 * 3072 + 3072 * 768)
    assert muon.optimizer == (block_matrices + 2 * (GPT2_SMALL_PARAMS - block_matrices)) * 4
    for unknown in ("adam", "sgd"):  # the optimizers core/training/optim.py builds, and no other
        with pytest.raises(ValueError, match="optimizer"):
            memory.estimate_training_memory(GPTConfig(), 1, unknown)


def test_activations_grow_with_batch_and_length_as_written():
    c = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=100)
    a = memory.estimate_training_memory(c, batch_size=3, seq_len=128)
    assert a.activations == 2 * 17 * 3 * 128 * 64 * 4 + 2 * 3 * 128 * 100 * 4
    naive = memory.estimate_training_memory(GPTConfig(**{**c.__dict__, "attn_backend": "naive"}), 3, seq_len=128)
    assert naive.activations - a.activations == 2 * 5 * 3 * 4 * 128 * 128 * 4 // 2  # the (T, T) scores
    assert a.total == a.params + a.grads + a.optimizer + a.activations


def test_activation_estimate_is_within_1_5x_of_a_measured_step():
    """The estimate against torch's allocator, measured: forward and backward of one micro-batch."""
    torch.manual_seed(0)
    c = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=512)
    model = GPT(c)
    x = torch.randint(0, 512, (8, 128))

    def step():
        _, loss = model(x, x)
        loss.backward()

    step()  # gradients exist from now on, as in every later step
    measured = common.cpu_peak_extra_bytes({"step": step})["step"]
    est = memory.estimate_training_memory(c, batch_size=8).activations
    assert est / 1.5 < measured < est * 1.5, (measured, est)  # 26.3 MB measured, 22.0 MB estimated


def test_gpt2_fit_table_per_gpu(monkeypatch):
    """bench.py's "which GPT-2 fits where" table (README, Sharding) is benchmarks.memory.gpu_training_memory:
    16 bytes of state per parameter, 1/8 of it under fsdp plus two gathered Blocks (bf16 weights,
    float32 gradients), and Korthikanti's 34 bytes per token and channel per layer at bf16."""
    counts = {name: memory.parameter_count(GPTConfig(**shape)) for name, shape in GPT2_SHAPES.items()}
    assert counts == {"gpt2": GPT2_SMALL_PARAMS, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                      "gpt2-xl": 1_557_611_200}  # transformers' GPT2LMHeadModel, tied head counted once
    xl, n, C, L, tokens = GPTConfig(**GPT2_SHAPES["gpt2-xl"]), counts["gpt2-xl"], 1600, 48, 4 * 1024
    ddp, fsdp = (bench_memory.gpu_training_memory(xl, how, 8, micro_batch=4) for how in ("ddp", "fsdp"))
    assert ddp.params + ddp.grads + ddp.optimizer == 16 * n
    assert fsdp.params + fsdp.grads + fsdp.optimizer == 16 * n // 8 + 2 * (12 * C * C + 13 * C) * (2 + 4)
    logits = 8 * tokens * 50257
    assert ddp.activations == fsdp.activations == L * 34 * tokens * C + logits
    ac = bench_memory.gpu_training_memory(xl, "ddp", 8, micro_batch=4, activation_checkpointing=True)
    assert ac.activations == L * 2 * tokens * C + 34 * tokens * C + logits
    monkeypatch.setattr(bench_memory, "GPU_GB", (24, 32, 80, 141))  # 32 GB: where only checkpointing fits XL
    rows = {(r["model"], r["parallel"]): r for r in bench_memory.fits_rows(micro_batch=4, world_size=8)}
    assert rows["gpt2-xl", "ddp"]["gb"] == ddp.total / 1e9 and rows["gpt2-xl", "fsdp"]["gb"] == fsdp.total / 1e9
    assert rows["gpt2-xl", "ddp"]["gb_checkpointed"] == ac.total / 1e9
    assert rows["gpt2-xl", "ddp"]["fits"] == {"24": "no", "32": "with AC", "80": "yes", "141": "yes"}  # 37 GB, 27 with AC
    assert rows["gpt2-xl", "fsdp"]["fits"]["24"] == "yes"  # 16 GB
    assert rows["gpt2", "ddp"]["params"] == GPT2_SMALL_PARAMS


def test_available_bytes_reads_this_machine():
    free = memory.available_bytes("cpu")
    assert free is not None and 2**26 < free < 2**50
    assert format_bytes(3 * 2**30) == "3.0 GiB" and format_bytes(512) == "512 B" and format_bytes(2000) == "2.0 KiB"


def test_out_of_memory_errors_are_recognised():
    with pytest.raises(RuntimeError) as real:
        torch.empty(2**60, dtype=torch.uint8)  # past any address space: the CPU allocator refuses at once
    assert memory.is_out_of_memory(real.value)
    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    assert not memory.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.slow
def test_a_model_or_block_size_that_cannot_fit_is_one_line(tmp_path, data_dir):
    """The data check (before any model is built) refuses a block_size longer than
    the data; a model far too large for this machine is refused by the estimate, naming both sizes."""
    common = ["--device=cpu", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}"]
    long_block, huge_model = run_scripts(
        ["train.py", "config/train_shakespeare_char.py", *common, "--block_size=100000000"],
        ["train.py", "config/train_shakespeare_char.py", *common, "--block_size=64", "--n_embd=1048576",
         "--n_head=1", "--n_layer=1"])
    assert_user_error(long_block, "fewer than block_size + 1 = 100000001")
    assert_user_error(huge_model, "training needs about", "TiB", "is available", "smaller")
    for result in (long_block, huge_model):
        assert result.stderr.count("\n") == 1, result.stderr


def tiny_argv(tmp_path, data_dir, **overrides):
    args = dict(device="cpu", dtype="float32", compile=False, n_layer=1, n_head=2, n_embd=16, block_size=16,
                batch_size=2, max_iters=2, eval_interval=10, eval_iters=1, gradient_accumulation_steps=1,
                out_dir=tmp_path / "out", data_dir=data_dir) | overrides
    return cli_args(args)


def test_estimate_refuses_before_building(tmp_path, data_dir, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    built = []
    monkeypatch.setattr(train, "GPT", lambda *a: built.append(a))
    result = run_main(train.main, tiny_argv(tmp_path, data_dir))
    assert_user_error(result, "training needs about", "but only 1000 B is available", "batch_size 2 x block_size 16")
    assert built == []


def test_out_of_memory_at_build_is_one_line(tmp_path, data_dir, monkeypatch):
    def allocate(config):
        torch.empty(2**60, dtype=torch.uint8)  # a real allocator error

    monkeypatch.setattr(resolver, "GPT", allocate)  # where init_from=scratch builds the model
    result = run_main(train.main, tiny_argv(tmp_path, data_dir))
    assert_user_error(result, "out of memory on cpu", "can't allocate memory", "smaller batch_size")
    assert result.stderr.count("\n") == 1


def test_out_of_memory_at_the_first_step_is_one_line(tmp_path, data_dir, monkeypatch):
    forward = GPT.forward

    def oom(self, *args, **kwargs):  # the first training forward; the eval before it runs as it is
        if self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", oom)
    result = run_main(train.main, tiny_argv(tmp_path, data_dir))
    assert_user_error(result, "out of memory on cpu", "Tried to allocate 20.00 GiB", "intact")


def test_other_runtime_errors_are_not_hidden(tmp_path, data_dir, monkeypatch):
    forward = GPT.forward

    def bug(self, *args, **kwargs):
        if self.training:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", bug)
    with pytest.raises(RuntimeError, match="mat1"):
        run_main(train.main, tiny_argv(tmp_path, data_dir))


def test_the_memory_section_measures_less_peak_memory_with_activation_checkpointing():
    """bench.py's checkpointing rows (one process, torch's CPU allocator events): off, then on, the peak lower."""
    import bench
    from core import runtime
    cfg = bench.load_config(["--batch_size=8", "--warmup=0", "--repeats=1"])
    config = GPTConfig(block_size=128, vocab_size=64, n_layer=6, n_head=4, n_embd=64, dropout=0.0)
    off, on = bench_memory.activation_checkpointing_rows(cfg, runtime.setup("cpu", "float32"), config)
    assert (off["activation_checkpointing"], on["activation_checkpointing"]) == ("off", "on")
    assert 0 < on["peak_bytes"] < 0.5 * off["peak_bytes"] and off["step_s"] > 0 and on["step_s"] > 0
