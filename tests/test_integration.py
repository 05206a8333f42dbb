"""Where the branches meet: fsdp with Muon, the recipe switches, in-training HellaSwag, sharded resume,
the memory check, and eval.py / sample.py on what such a run saves.

    python -m pytest tests/test_integration.py                 # ~1 min on two busy CPU cores (3 torchrun jobs)
    python -m pytest tests/test_integration.py -m "not slow"   # the in-process ones, a few seconds

Under fsdp every forward is a collective (each Block all-gathers its weights), so every eval path must
run the same number of forwards on every rank; torch.optim.Muon works on the DTensor shards that
fully_shard leaves, and its DTensor math must equal the full-matrix math; checkpoints must carry both
of Muon's optimizers. The slow tests launch real 2-process gloo runs of a 1-layer, 32-wide model.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

import eval as eval_script
import sample
import train
from core import runtime
from core.evaluation import hellaswag, perplexity
from core.data.loader import TokenData
from core.data.tokenizer import CharTokenizer
from core.training import memory, preflight
from core.weights import checkpoint, resolver
from model import GPTConfig
from tests.helpers import (assert_user_error, char_data_fixture, cli_args, losses, records, run_main, run_scripts,
                           train_tiny)

TEXT = "the cat sat on the mat. the dog ate the bone. a bird sang in the tree. " * 30
HELLASWAG = [  # 5 examples: 2 ranks score 3 + 2, one of them a spare it must not count
    ("the cat sat on the", ["bone.", "mat.", "tree.", "ate."], 1),
    ("the dog ate the", ["bone.", "mat.", "sang.", "the cat"], 0),
    ("a bird sang in the", ["mat.", "bone.", "cat.", "tree."], 3),
    ("the dog", ["sat on", "sang in", "ate the", "in the"], 2),
    ("a bird", ["ate the", "sang in", "sat on", "on the mat"], 1),
]
# config/modern.py's switches, plus GQA and SwiGLU, which it leaves off
MODERN = dict(pos_embedding="rope", norm="rmsnorm", qk_norm=True, mlp="swiglu", n_head=2, n_kv_head=1,
              tie_embeddings=False, logit_softcap=15.0, optimizer="muon", muon_lr=0.02)
# eval_iters=3 is odd: 2 ranks split it 2 + 1 (plus a spare); 4 micro-batches per step, 2 per process.
RUN = dict(n_layer=1, n_embd=32, block_size=32, batch_size=4, gradient_accumulation_steps=4, max_iters=10,
           lr_decay_iters=10, warmup_iters=0, log_interval=1, eval_interval=5, eval_iters=3, dist_timeout_s=60.0,
           parallel="fsdp", device="cpu", dtype="float32", compile=False)
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def write_hellaswag(path: Path) -> Path:
    path.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": label}) + "\n" for c, e, label in HELLASWAG))
    return path


def evals(out_dir) -> dict[int, dict]:
    return {r["iter"]: r for r in records(out_dir) if "val_loss" in r}


data_dir = char_data_fixture(TEXT)


# -----------------------------------------------------------------------------
# in-process


class CountingModel(torch.nn.Module):
    """A model that counts its forwards: what each rank would put through an fsdp all-gather."""

    def __init__(self, vocab: int):
        super().__init__()
        self.config = GPTConfig(vocab_size=vocab, block_size=32, n_layer=1, n_head=1, n_embd=8)
        self.forwards = 0

    def forward(self, x, y=None):
        self.forwards += 1
        logits = torch.zeros(*x.shape, self.config.vocab_size)
        return logits, torch.zeros(()) if y is not None else None


def test_estimate_loss_runs_in_eval_mode_and_hands_the_model_back_training(data_dir):
    """Dropout off during train.py's eval (its losses comparable from one eval to the next), no graph kept, and
    the model training again afterwards, also when a signal ends the eval early."""
    data = {split: TokenData(data_dir, split, 32) for split in ("train", "val")}
    cfg = train.TrainConfig(eval_iters=2, batch_size=2, block_size=32)
    rt = runtime.Runtime("cpu", "cpu", "float32")
    seen = []

    class ModeSeeingModel(CountingModel):
        def forward(self, x, y=None):
            seen.append((self.training, torch.is_grad_enabled()))  # (dropout on, a graph kept)
            return super().forward(x, y)

    model = ModeSeeingModel(CharTokenizer.from_text(TEXT).vocab_size)
    assert set(train.estimate_loss(model, data, cfg, rt)) == {"train", "val"}
    assert seen and set(seen) == {(False, False)} and model.training
    assert train.estimate_loss(model, data, cfg, rt, stopped=lambda: True) is None and model.training


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_runs_as_many_eval_forwards(data_dir, tmp_path, monkeypatch, world_size):
    """estimate_loss (eval_iters=5), evaluate_hellaswag (5 examples) and evaluate_split on each rank of 2
    and 3: the same number of forwards everywhere, or an fsdp run hangs at its first eval. Collectives
    are no-ops here."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    data = {split: TokenData(data_dir, split, 32) for split in ("train", "val")}
    tok = CharTokenizer.from_text(TEXT)
    rendered = hellaswag.render_examples(hellaswag.load_hellaswag(write_hellaswag(tmp_path / "hs.jsonl")), tok, 32)
    cfg = train.TrainConfig(eval_iters=5, batch_size=2, block_size=32)
    eval_forwards, hellaswag_forwards, split_forwards, examples, tokens = [], [], [], 0, 0
    for rank in range(world_size):
        rt = runtime.Runtime("cpu", "cpu", "float32", rank=rank, world_size=world_size)
        model = CountingModel(tok.vocab_size)
        train.estimate_loss(model, data, cfg, rt)
        eval_forwards.append(model.forwards)
        model.forwards = 0
        examples += hellaswag.evaluate_hellaswag(model, rendered, rank=rank, world_size=world_size)["examples"]
        hellaswag_forwards.append(model.forwards)
        model.forwards = 0
        tokens += perplexity.evaluate_split(model, data["val"], batch_size=2, rank=rank, world_size=world_size).tokens
        split_forwards.append(model.forwards)
    assert len(set(eval_forwards)) == 1 and eval_forwards[0] >= 2 * 5 / world_size, eval_forwards
    assert len(set(hellaswag_forwards)) == 1 and hellaswag_forwards[0] >= 5 / world_size, hellaswag_forwards
    assert len(set(split_forwards)) == 1, split_forwards  # whole-split perplexity (eval.py)
    assert examples == 5 and tokens == data["val"].sizes[0] - 1  # the spares are scored, never counted


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, data_dir):
    """One process, Muon, 2 micro-steps: 6 iterations, then a resume to 12 with new learning rates, once
    with parallel=fsdp (ckpt.dcp, through torch.distributed.checkpoint) and once with ddp (ckpt.pt)."""
    root = tmp_path_factory.mktemp("resumed")
    common = dict(optimizer="muon", gradient_accumulation_steps=2, log_interval=1, max_iters=6, lr_decay_iters=12,
                  eval_interval=6, warmup_iters=2)
    for parallel in ("fsdp", "ddp"):
        train_tiny(root / parallel, data_dir, parallel=parallel, **common)
        train_tiny(root / parallel, data_dir, parallel=parallel, **common | dict(
            init_from="resume", max_iters=12, learning_rate=5e-3, min_lr=5e-4, muon_lr=0.01))
    return root


def test_sharded_resume_restores_both_muon_optimizers_and_keeps_new_learning_rates(resumed):
    """A sharded checkpoint holds Muon's and AdamW's state (a MultiOptimizer, which DCP cannot see into
    by itself), and a resume runs at the learning rates it is given, exactly as a ckpt.pt resume does."""
    assert (resumed / "fsdp" / "ckpt.dcp").is_dir() and (resumed / "ddp" / "ckpt.pt").is_file()
    fsdp, ddp = dict(losses(resumed / "fsdp")), dict(losses(resumed / "ddp"))
    assert sorted(fsdp) == sorted(ddp) == list(range(12))
    assert [fsdp[i] for i in range(12)] == [ddp[i] for i in range(12)]


def test_resuming_a_sharded_checkpoint_with_the_other_optimizer_is_one_line(resumed, data_dir):
    result = run_main(train.main, cli_args(
        out_dir=resumed / "fsdp", data_dir=data_dir, n_layer=1, n_head=2, n_embd=32, block_size=32, device="cpu",
        compile=False, init_from="resume", parallel="fsdp", optimizer="adamw", max_iters=14))
    assert_user_error(result, "trained with optimizer=muon", "--optimizer=muon")


def test_memory_check_counts_fsdp_shards_and_activation_checkpointing(monkeypatch):
    """Under fsdp each process holds 1/N of the state (plus the Blocks it gathers), and activation
    checkpointing keeps only each Block's input: train.py's check lets through what fits that way."""
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=512)
    params = memory._params_on_meta(config)
    n = sum(p.numel() for _, p in params)
    block = sum(p.numel() for name, p in params if name.startswith("transformer.h.0."))
    est = {(shards, micro, ac): memory.estimate_training_memory(config, 4, "adamw", seq_len=64, shards=shards,
                                                                micro_steps=micro, activation_checkpointing=ac)
           for shards, micro, ac in [(1, 1, False), (8, 1, False), (8, 2, False), (8, 1, True)]}
    full = est[1, 1, False]
    assert (full.params, full.optimizer) == (4 * n, 8 * n)
    assert est[8, 1, False].optimizer == full.optimizer // 8
    assert est[8, 1, False].params == 4 * n // 8 + 4 * 2 * block  # two Blocks gathered at a time
    assert est[8, 2, False].params == 4 * n // 8 + 4 * n  # every Block stays gathered between micro-steps
    assert est[8, 1, True].activations < full.activations / 2 and est[8, 1, True].params == est[8, 1, False].params

    cfg = train.TrainConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=4, gradient_accumulation_steps=8)
    rt = runtime.Runtime("cpu", "cpu", "float32", world_size=8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # 8 processes, each with memory of its own
    for free, parallel, ac, fits in [(est[8, 1, False].total, "ddp", False, False), (est[8, 1, False].total, "fsdp", False, True),
                                     (est[8, 1, True].total, "fsdp", False, False), (est[8, 1, True].total, "fsdp", True, True)]:
        monkeypatch.setattr(memory, "available_bytes", lambda device: free)
        cfg.parallel, cfg.activation_checkpointing = parallel, ac
        if fits:
            preflight.check_memory(config, cfg, rt)
        else:
            with pytest.raises(memory.UserError, match="training needs about"):
                preflight.check_memory(config, cfg, rt)


# -----------------------------------------------------------------------------
# 2 processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """At once: 2-process fsdp and 1 process, both with the modern recipe, Muon and in-training HellaSwag,
    10 iterations saved at 5 and 10; then a copy of the 2-process run, resumed at 5 on 2 processes."""
    root = tmp_path_factory.mktemp("runs")
    hs = write_hellaswag(root / "hs.jsonl")
    cfg = RUN | MODERN | {"data_dir": data_dir, "hellaswag_file": hs}

    def argv(name, **more):
        return cli_args(cfg | {"out_dir": root / name} | more)
    results = run_scripts([*TORCHRUN, "train.py", *argv("fsdp2")], ["train.py", *argv("one")], timeout=400)
    shutil.copytree(root / "fsdp2", root / "half")  # then back to its checkpoint at 5, the one before the last
    shutil.rmtree(root / "half" / checkpoint.SHARDED_NAME)
    (root / "half" / checkpoint.PREV_SHARDED_NAME).rename(root / "half" / checkpoint.SHARDED_NAME)
    results += run_scripts([*TORCHRUN, "train.py", *argv("half", init_from="resume")], timeout=300)
    for r in results:
        assert r.returncode == 0, f"{r.args}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return root


@pytest.mark.slow
def test_two_process_fsdp_modern_muon_with_hellaswag_equals_one_process(runs):
    """Muon on the DTensor shards equals Muon on the full matrices: the losses agree to float rounding
    (a per-shard orthogonalisation would be off by far more). The evals (eval_iters=3 over 2 ranks, 5
    HellaSwag examples over 2 ranks) ran on both ranks without a hang and agree with one process."""
    two, one = dict(losses(runs / "fsdp2")), dict(losses(runs / "one"))
    assert sorted(two) == sorted(one) == list(range(10))
    for it in range(10):
        # float reduction order differs across ranks, and Muon's orthogonalisation grows it: 1.1e-4 seen at
        # iteration 5 on a 46-id vocabulary
        assert two[it] == pytest.approx(one[it], rel=2e-4, abs=1e-5), (it, two[it], one[it])
    assert two[9] < two[0] - 0.3  # it learns: Muon's updates were applied
    e2, e1 = evals(runs / "fsdp2"), evals(runs / "one")
    assert sorted(e2) == sorted(e1) == [0, 5, 10]
    for it in e2:
        for key in ("train_loss", "val_loss"):
            assert e2[it][key] == pytest.approx(e1[it][key], rel=2e-4), (it, key)
        assert (e2[it]["hellaswag_acc"], e2[it]["hellaswag_acc_norm"]) == (e1[it]["hellaswag_acc"],
                                                                            e1[it]["hellaswag_acc_norm"])


MUON_ON_DTENSOR = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz, DEFAULT_A, DEFAULT_B, DEFAULT_C
sys.path.insert(0, os.getcwd())  # the repository root: this script lives in a temporary folder
from core.training.optim import BatchedMuon
dist.init_process_group("gloo")
mesh, rank = torch.distributed.device_mesh.init_device_mesh("cpu", (2,)), dist.get_rank()
torch.manual_seed(0)
report = open(f"{sys.argv[1]}/rank{rank}.txt", "w")  # one file per rank: their stdout lines would interleave
for muon_class in (torch.optim.Muon, BatchedMuon):  # bf16 Newton-Schulz (torch's), and float32 (ours)
    for shape in [(96, 32), (32, 96)]:  # both orientations: Newton-Schulz transposes the tall one
        w, grads = torch.randn(shape) * 0.1, [torch.randn(shape) for _ in range(3)]
        full, sharded = torch.nn.Parameter(w.clone()), torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        for p in (full, sharded):
            opt = muon_class([p], lr=0.02, momentum=0.95, weight_decay=0.0, adjust_lr_fn="original")
            for g in grads:
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)]) if p is sharded else g.clone()
                opt.step()
        update, sharded_update = full.detach() - w, sharded.detach().full_tensor() - w
        coeffs = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
        per_shard = _zeropower_via_newtonschulz(grads[0].chunk(2)[rank], coeffs, 5, 1e-7)
        whole = _zeropower_via_newtonschulz(grads[0], coeffs, 5, 1e-7).chunk(2)[rank]
        print(muon_class.__name__, shape, (update - sharded_update).abs().max().item() / update.abs().max().item(),
              (per_shard - whole).abs().max().item() / whole.abs().max().item(), file=report)
report.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_muon_on_dtensor_shards_does_the_full_matrix_math(tmp_path):
    """torch.optim.Muon knows nothing of DTensor, yet on fully_shard's Shard(0) DTensors its Newton-Schulz
    matmuls gather what they need: 3 steps update the weights as Muon on the full matrix does, to
    bfloat16 rounding (torch's Newton-Schulz runs in bfloat16) or float32 rounding (BatchedMuon in float32, what
    CPUs without native bf16 get), while orthogonalising each shard on its own would be a different
    update altogether."""
    script = tmp_path / "muon_dtensor.py"
    script.write_text(MUON_ON_DTENSOR)
    result = run_scripts([*TORCHRUN, script, tmp_path], timeout=200)[0]
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for rank in (0, 1) for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    assert len(rows) == 8, rows
    for row in rows:
        sharded_vs_full, per_shard_vs_full = float(row[-2]), float(row[-1])
        bound = 0.1 if row[0] == "Muon" else 1e-4  # bf16 rounding, or float32's
        assert sharded_vs_full < bound and per_shard_vs_full > 0.3, row


@pytest.mark.slow
def test_two_process_fsdp_modern_muon_resumes_exactly(runs):
    half, whole = dict(losses(runs / "half")), dict(losses(runs / "fsdp2"))
    assert sorted(half) == list(range(10))
    assert [half[i] for i in range(10)] == [whole[i] for i in range(10)]


@pytest.mark.slow
def test_eval_and_sample_rebuild_the_variant_from_a_sharded_checkpoint(runs):
    """eval.py and sample.py read ckpt.dcp written by 2 processes, rebuild the recipe variant, and score
    it as the 1-process run's checkpoint scores; eval.py's HellaSwag equals the in-training figure."""
    model, _, source = resolver.load_model("resume", runs / "fsdp2")
    assert "ckpt.dcp" in source
    assert {k: getattr(model.config, k) for k in MODERN if hasattr(model.config, k)} == \
        {k: v for k, v in MODERN.items() if hasattr(model.config, k)}
    lines = {}
    for name in ("fsdp2", "one"):
        result = run_main(eval_script.main, [f"--out_dir={runs / name}", "--device=cpu", "--dtype=float32"])
        assert result.returncode in (0, None), result.stderr
        lines[name] = result.stdout.strip()
    loss2, loss1 = (float(lines[n].split("loss ")[1].split()[0]) for n in ("fsdp2", "one"))
    assert loss2 == pytest.approx(loss1, abs=2e-4) and loss2 < 3.0, lines
    result = run_main(eval_script.main, [f"--out_dir={runs / 'fsdp2'}", "--device=cpu", "--task=hellaswag",
                                         f"--hellaswag_file={runs / 'hs.jsonl'}"])
    final = evals(runs / "fsdp2")[10]
    assert f"acc {final['hellaswag_acc']:.4f} | acc_norm {final['hellaswag_acc_norm']:.4f} | 5 examples" in result.stdout
    result = run_main(sample.main, [f"--out_dir={runs / 'fsdp2'}", "--device=cpu", "--num_samples=1",
                                    "--max_new_tokens=40", "--temperature=0", "--start=the cat"])
    assert result.returncode in (0, None), result.stderr
    assert result.stdout.startswith("the cat") and len(result.stdout.split("---")[0].strip()) >= 40
