"""Train a GPT: one process, or many under torchrun, through the same code path.

    python train.py config/train_shakespeare_char.py            # the baby GPT, one device
    python train.py config/train_shakespeare_char.py --device=cpu --max_iters=200
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py
    torchrun --nnodes=2 --node_rank=0 --rdzv_endpoint=HOST:29500 --nproc_per_node=8 train.py config/gpt2_small.py
    python train.py config/train_shakespeare_char.py --init_from=resume   # continue from out_dir/ckpt.pt
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py --parallel=fsdp   # sharded: core/parallel.py

Configuration: the TrainConfig defaults below, overridden by config files (Python
files that assign names), overridden by --key=value. The resolved config is written
to out_dir/config.json, and every logged iteration and eval to out_dir/log.jsonl.

SIGTERM or SIGINT (Ctrl-C) finishes the current step, saves a checkpoint and exits 0.
"""
import dataclasses
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from core import checkpoint, config as configlib, evaluate, memory, optim, parallel, runtime
from core.data import TokenData, batch_generator, read_meta
from core.errors import UserError, first_line, run_cli
from core.fileio import atomic_path, write_json
from core.tokenizer import tokenizer_from_meta
from model import GPT, GPTConfig

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout", "attn_backend")
# The modern-recipe switches (GPTConfig's fields of the same names; README "Modern recipe").
RECIPE_KEYS = ("pos_embedding", "rope_base", "norm", "qk_norm", "mlp", "n_kv_head", "tie_embeddings", "logit_softcap")


@dataclasses.dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 2000
    log_interval: int = 1
    eval_iters: int = 200
    eval_only: bool = False
    hellaswag_file: str | None = None     # also score HellaSwag at each eval (data/hellaswag/prepare.py)
    always_save_checkpoint: bool = True   # at each eval; False keeps only val-loss improvements
    checkpoint_interval: int = 0          # also save every N iterations (0: only at evals and the end)
    init_from: str = "scratch"            # 'scratch', 'resume', a GPT-2 name, or a save_pretrained dir
    # logging
    wandb_log: bool = False
    wandb_project: str = "nanogpt"
    wandb_run_name: str = "run"
    # data
    data_dir: str = "data/fineweb"
    gradient_accumulation_steps: int = 40  # global: across all processes together
    batch_size: int = 12                   # micro-batch per process
    block_size: int = 1024
    # model
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attn_backend: str = "sdpa"
    vocab_size: int | None = None          # None: the dataset's meta.json vocab_size
    # the modern recipe, one switch each (see model.GPTConfig); the defaults are GPT-2
    pos_embedding: str = "learned"         # learned | rope
    rope_base: float = 10000.0
    norm: str = "layernorm"                # layernorm | rmsnorm
    qk_norm: bool = False
    mlp: str = "gelu"                      # gelu | relu2 | swiglu
    n_kv_head: int | None = None           # None: n_head; fewer: grouped-query attention
    tie_embeddings: bool = True
    logit_softcap: float | None = None
    optimizer: str = "adamw"               # adamw | muon (Muon for hidden matrices, AdamW for the rest)
    muon_lr: float = 0.02                  # Muon's peak lr; learning_rate stays AdamW's, the schedule scales both
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    # AdamW
    learning_rate: float = 6e-4
    max_iters: int = 600000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0                 # 0 disables clipping
    # learning-rate schedule: linear warmup, then cosine decay to min_lr
    decay_lr: bool = True
    warmup_iters: int = 2000
    lr_decay_iters: int = 600000
    min_lr: float = 6e-5
    # system
    device: str = "auto"                   # auto, cpu, cuda, cuda:N, mps
    dtype: str = "auto"                    # auto, float32, bfloat16, float16
    compile: bool | None = None            # None: on for CUDA, off elsewhere
    seed: int = 1337
    dist_timeout_s: float = 600.0          # a dead peer ends the job after this, never a hang
    parallel: str = "ddp"                  # ddp: full copies per process; fsdp: sharded (core/parallel.py)
    activation_checkpointing: bool = False  # recompute each Block in the backward pass: less memory, more compute

    def model_args(self) -> dict:
        """The GPTConfig fields this config sets; vocab_size comes from the dataset (or the checkpoint)."""
        return {k: getattr(self, k) for k in MODEL_KEYS + RECIPE_KEYS if k != "vocab_size"}

    def validate(self) -> None:
        positive = ("eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                    "block_size", "n_layer", "n_head", "n_embd", "max_iters", "lr_decay_iters")
        for key in positive:
            if getattr(self, key) < 1:
                raise UserError(f"config key '{key}' must be at least 1, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attn_backend not in ("sdpa", "naive"):
            raise UserError(f"attn_backend must be 'sdpa' or 'naive', got '{self.attn_backend}'")
        try:  # the recipe switches and their combinations: GPTConfig is their one judge
            GPTConfig(**self.model_args())
        except ValueError as e:
            raise UserError(str(e)) from None
        if self.optimizer not in optim.OPTIMIZERS:
            raise UserError(f"optimizer must be one of {', '.join(optim.OPTIMIZERS)}, got '{self.optimizer}'")
        if not (self.muon_lr > 0 and 0 <= self.muon_momentum < 1 and self.muon_weight_decay >= 0):
            raise UserError(f"need muon_lr > 0, 0 <= muon_momentum < 1, muon_weight_decay >= 0, got {self.muon_lr}, "
                            f"{self.muon_momentum}, {self.muon_weight_decay}")
        if not 0 < self.learning_rate < math.inf:
            raise UserError(f"need 0 < learning_rate < inf, got {self.learning_rate}")
        # min_lr is where the cosine decay ends; with decay_lr=False the rate stays at learning_rate.
        if self.decay_lr and not 0 <= self.min_lr <= self.learning_rate:
            raise UserError(f"need 0 <= min_lr <= learning_rate with decay_lr=True, got min_lr={self.min_lr}, "
                            f"learning_rate={self.learning_rate}")
        if self.warmup_iters < 0 or self.checkpoint_interval < 0:
            raise UserError("warmup_iters and checkpoint_interval must not be negative")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0) or self.weight_decay < 0:
            raise UserError(f"need 0 <= beta1, beta2 < 1 and weight_decay >= 0, got {self.beta1}, {self.beta2}, "
                            f"{self.weight_decay}")
        parallel.check_parallel(self.parallel, self.dtype)
        if not self.dist_timeout_s > 0:
            raise UserError(f"dist_timeout_s must be positive, got {self.dist_timeout_s}")
        if self.init_from not in ("scratch", "resume", *GPT2_NAMES) and not Path(self.init_from).is_dir():
            raise UserError(f"unknown init_from '{self.init_from}'; use scratch, resume, "
                            f"{', '.join(GPT2_NAMES)}, or a directory written by save_pretrained")


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def local_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    if cfg.gradient_accumulation_steps % world_size:
        raise UserError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by the "
                        f"number of processes ({world_size}); it counts micro-steps across all processes")
    return cfg.gradient_accumulation_steps // world_size


# -----------------------------------------------------------------------------
# model and checkpoint state


def tokenizer_meta(meta: dict) -> dict:
    """The part of a dataset's meta.json that sample.py needs to rebuild the tokenizer."""
    return {k: meta[k] for k in ("tokenizer", "vocab_size", "itos", "stoi", "eot_token", "special_tokens") if k in meta}


def check_same_tokenizer(tok: dict, data_meta: dict, data_dir: str) -> None:
    """A resumed model must read the dataset through the tokenizer it was trained with."""
    if tok == tokenizer_meta(data_meta):
        return
    kind, vocab = data_meta.get("tokenizer"), data_meta.get("vocab_size")
    if (tok.get("tokenizer"), tok.get("vocab_size")) != (kind, vocab):
        raise UserError(f"the dataset in {data_dir} uses tokenizer {kind!r} with vocab {vocab}, but the checkpoint "
                        f"was trained on {tok.get('tokenizer')!r} with vocab {tok.get('vocab_size')}; use the same dataset")
    # e.g. two character vocabularies of the same size
    raise UserError(f"the dataset in {data_dir} maps tokens differently from the checkpoint's {kind!r} vocabulary "
                    "of the same size; use the dataset it was trained on")


def build_model(cfg: TrainConfig, data_meta: dict, resume_state: dict | None,
                rt: runtime.Runtime) -> tuple[GPT, dict]:
    """The model for cfg.init_from, and the tokenizer metadata it is trained with. A run that plainly does
    not fit in memory stops before the model is built (scratch, resume), or as soon as GPT-2's weights load."""
    if resume_state is not None:
        saved = resume_state["meta"]
        margs = saved["model_args"]
        gpt2 = GPTConfig()
        for key in ("n_layer", "n_head", "n_embd", "bias", "vocab_size") + RECIPE_KEYS:
            mine, theirs = getattr(cfg, key), margs.get(key, getattr(gpt2, key))
            if key == "n_kv_head":  # None and n_head are the same attention
                mine, theirs = mine or cfg.n_head, theirs or margs["n_head"]
            if mine is not None and mine != theirs:
                raise UserError(f"config {key}={mine} differs from the checkpoint's {theirs}; resume with the "
                                "config the run started with, or use a new out_dir")
        if cfg.block_size > margs["block_size"]:
            raise UserError(f"block_size {cfg.block_size} is larger than the checkpoint's {margs['block_size']}; "
                            f"resume with --block_size={margs['block_size']} or smaller")
        check_memory(GPTConfig(**margs), cfg, rt)
        model = checkpoint.model_from_checkpoint(resume_state, dropout=cfg.dropout, attn_backend=cfg.attn_backend)
        tok = saved["tokenizer"]
        check_same_tokenizer(tok, data_meta, cfg.data_dir)
    elif cfg.init_from == "scratch":
        vocab = cfg.vocab_size or data_meta.get("vocab_size")
        if not isinstance(vocab, int):
            raise UserError(f"{cfg.data_dir}/meta.json has no integer vocab_size; re-run the dataset's prepare.py")
        margs = cfg.model_args() | {"vocab_size": vocab}
        check_memory(GPTConfig(**margs), cfg, rt)
        model = GPT(GPTConfig(**margs))
        tok = tokenizer_meta(data_meta)
    else:  # GPT-2 weights from the hub or a save_pretrained directory
        if data_meta.get("tokenizer") != "gpt2":
            raise UserError(f"init_from={cfg.init_from} needs a dataset tokenized with GPT-2's BPE, but "
                            f"{cfg.data_dir} uses {data_meta.get('tokenizer')!r}")
        switched = GPTConfig(**cfg.model_args()).non_gpt2_fields()
        if switched:
            raise UserError(f"init_from={cfg.init_from} loads GPT-2's architecture, which has none of "
                            f"{', '.join(switched)}; drop those settings (or config/modern.py) to fine-tune it")
        try:
            model = GPT.from_pretrained(cfg.init_from, {"dropout": cfg.dropout, "attn_backend": cfg.attn_backend})
        except (OSError, ValueError) as e:
            raise UserError(f"could not load GPT-2 weights '{cfg.init_from}': {first_line(e)}") from None
        # Weights are loaded by now (on the CPU); the optimizer, activations and the device copy are not.
        check_memory(dataclasses.replace(model.config, block_size=min(cfg.block_size, model.config.block_size)),
                     cfg, rt)
        tok = tokenizer_meta(data_meta)
    data_vocab = data_meta.get("vocab_size")
    if not isinstance(data_vocab, int):
        raise UserError(f"{cfg.data_dir}/meta.json has no integer vocab_size; re-run the dataset's prepare.py")
    if data_vocab > model.config.vocab_size:
        raise UserError(f"{cfg.data_dir}/meta.json has vocab_size {data_vocab}, larger than the model's vocab_size "
                        f"{model.config.vocab_size}; token ids would index past the embedding table")
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    elif cfg.block_size > model.config.block_size:
        raise UserError(f"block_size {cfg.block_size} is larger than the model's {model.config.block_size}")
    return model, tok


def check_memory(config: GPTConfig, cfg: TrainConfig, rt: runtime.Runtime) -> None:
    """One line, before any allocation, when weights, optimizer and activations plainly exceed free memory."""
    shards = rt.world_size if cfg.parallel == "fsdp" else 1
    est = memory.estimate_training_memory(config, cfg.batch_size, cfg.optimizer, compute_dtype=rt.ptdtype,
                                          seq_len=cfg.block_size, shards=shards,
                                          micro_steps=local_accum_steps(cfg, rt.world_size),
                                          activation_checkpointing=cfg.activation_checkpointing)
    # Processes on one machine share its RAM; each GPU has its own memory.
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if rt.device_type == "cpu" else 1
    memory.check_fits(est, rt.device, sharing, f" for batch_size {cfg.batch_size} x block_size {cfg.block_size}")


def gather_rng(rt: runtime.Runtime) -> dict:
    """Every rank's RNG states (dropout draws from them), collected on each rank."""
    states = {"cpu": torch.get_rng_state()}
    if rt.device_type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(rt.device)
    if not rt.ddp:
        return {k: [v] for k, v in states.items()}
    comm_device = rt.device if rt.device_type == "cuda" else "cpu"
    gathered = {}
    for key, state in states.items():
        parts = [torch.empty_like(state, device=comm_device) for _ in range(rt.world_size)]
        dist.all_gather(parts, state.to(comm_device))
        gathered[key] = [p.cpu() for p in parts]
    return gathered


def restore_rng(rng: dict | None, rt: runtime.Runtime, log) -> None:
    saved = len(rng["cpu"]) if rng else 0
    if saved != rt.world_size:
        log(f"note: the checkpoint was saved by {saved or 'an unknown number of'} process(es), this run has "
            f"{rt.world_size}: each iteration reads the same global batch (from seed and iteration), but dropout "
            f"draws are re-seeded, so losses will not repeat the first run's bit for bit")
        return
    torch.set_rng_state(rng["cpu"][rt.rank])
    if rt.device_type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"][rt.rank], rt.device)


def all_finite(module: torch.nn.Module, rt: runtime.Runtime) -> bool:
    """Whether every weight is finite, on every rank (fsdp: each holds a shard, so all must agree)."""
    finite = all(bool(torch.isfinite(parallel.local(p)).all()) for p in module.parameters())
    if not parallel.is_sharded(module):
        return finite
    flag = torch.tensor(float(finite), device=rt.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# -----------------------------------------------------------------------------
# the loop


@torch.no_grad()
def estimate_loss(model, data: dict[str, TokenData], cfg: TrainConfig, rt: runtime.Runtime) -> dict[str, float]:
    """Mean loss over eval_iters fixed batches per split, shared among the processes.

    Eval batches come from their own generators, so evaluating never changes which
    batches training reads, and every eval uses the same batches (comparable numbers).
    """
    out = {}
    model.eval()
    for split, ds in data.items():
        total = torch.zeros(2, device=rt.device)  # (sum of losses, count)
        # Every rank runs as many forwards: under fsdp each one is a collective (its all-gathers).
        padded = -(-cfg.eval_iters // rt.world_size) * rt.world_size
        for k in range(rt.rank, padded, rt.world_size):
            x, y = ds.get_batch(cfg.batch_size, batch_generator(cfg.seed, "eval", split, k % cfg.eval_iters), rt.device)
            with rt.autocast():
                _, loss = model(x, y)
            if k < cfg.eval_iters:
                total += torch.stack([loss.float(), torch.ones((), device=rt.device)])
        if rt.ddp:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves and exits after the current step. A second
    SIGINT interrupts at once."""

    def __init__(self):
        self.signal_name = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name


class JsonLog:
    """out_dir/log.jsonl: one JSON record per logged iteration and per eval."""

    def __init__(self, path: Path, resume_iter: int | None):
        self.path = path
        if resume_iter is None:
            path.unlink(missing_ok=True)
        elif path.exists():
            # Keep only the iterations before the checkpoint: the resumed run redoes the rest, and
            # the log then reads as one run. A line cut short by a kill is dropped with them.
            kept = [line for line in path.read_text().splitlines() if _record_iter(line) < resume_iter]
            try:
                with atomic_path(path) as tmp:
                    tmp.write_text("".join(line + "\n" for line in kept))
            except OSError as e:
                raise self._error(e) from None

    def write(self, record: dict) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # disk full: stop with one line, the last checkpoint is intact
            raise self._error(e) from None

    def _error(self, e: OSError) -> UserError:
        return UserError(f"could not write {self.path}: {e.strerror or e}; the last checkpoint is intact")


def _record_iter(line: str) -> float:
    try:
        return json.loads(line)["iter"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def main(argv) -> None:
    cfg = configlib.parse_args(TrainConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.dist_timeout_s)
    try:
        train(cfg, rt)
    except RuntimeError as e:  # torch.OutOfMemoryError included
        if not memory.is_out_of_memory(e):
            raise
        raise memory.out_of_memory_error(e, rt.device, f"(checkpoints already in {cfg.out_dir} are intact)") from None
    finally:
        runtime.teardown(rt)


def prepare_out_dir(cfg: TrainConfig, rt: runtime.Runtime) -> Path:
    """Create out_dir and write the resolved config, before any training: an unwritable
    directory is found now, not at the first checkpoint."""
    out_dir = Path(cfg.out_dir)

    def write() -> None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json(out_dir / "config.json", configlib.to_dict(cfg) | {"world_size": rt.world_size,
                                                                          "device": rt.device, "dtype": rt.dtype})
        except OSError as e:
            raise UserError(f"cannot write to out_dir '{out_dir}': {e.strerror}; choose a writable --out_dir") from None
    rt.on_master(write)
    return out_dir


def train(cfg: TrainConfig, rt: runtime.Runtime) -> None:
    log = print if rt.is_master else (lambda *a, **k: None)
    accum = local_accum_steps(cfg, rt.world_size)
    out_dir = prepare_out_dir(cfg, rt)
    data_meta = read_meta(cfg.data_dir)

    resume_state = None
    if cfg.init_from == "resume" and cfg.parallel == "fsdp":  # weights and optimizer load after sharding
        saved_meta, path = checkpoint.load_latest_sharded(out_dir, log=log)
        resume_state = {"meta": saved_meta, "model": None}
    elif cfg.init_from == "resume":
        resume_state, path = checkpoint.load_latest(out_dir, log=log)
    if resume_state is not None:
        log(f"resuming from {path} at iter {resume_state['meta']['iter_num']}")
        saved_world = resume_state["meta"].get("world_size", rt.world_size)
        if saved_world != rt.world_size:
            log(f"note: the checkpoint was saved by {saved_world} process(es) and resumes on {rt.world_size}: "
                f"the same global batch ({cfg.gradient_accumulation_steps} micro-batches) split differently, so "
                f"losses match the uninterrupted run to float rounding, not bit for bit")
    # The data first: a missing file or a block_size longer than the data is found in a second,
    # before a model of that block_size is built.
    data = {split: TokenData(cfg.data_dir, split, cfg.block_size) for split in ("train", "val")}
    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model, tok_meta = build_model(cfg, data_meta, resume_state, rt)
    # Then dropout masks of their own per rank (batches come from their own generators, never from this).
    torch.manual_seed(cfg.seed + rt.rank)
    hellaswag = None if cfg.hellaswag_file is None else evaluate.render_examples(
        evaluate.load_hellaswag(cfg.hellaswag_file), tokenizer_from_meta(tok_meta), model.config.block_size)
    model.to(rt.device)
    raw_model = model  # what is saved: never the compiled or DDP-wrapped module (fsdp shards it in place)
    compile = cfg.compile if cfg.compile is not None else rt.device_type == "cuda"
    model = parallel.parallelize(raw_model, rt, cfg.parallel, cfg.activation_checkpointing, compile)

    # built after sharding: fully_shard replaces the parameters with their shards
    optimizer = optim.build_optimizer(raw_model, cfg.optimizer, cfg.learning_rate, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                                      rt.device_type, cfg.muon_lr, cfg.muon_momentum, cfg.muon_weight_decay)
    scaler = rt.grad_scaler()
    iter_num, best_val_loss = 0, float("inf")
    if resume_state is not None:
        if resume_state["model"] is None:
            with optim.restoring(optimizer, resume_state["meta"]["config"].get("optimizer", "adamw")):
                resume_state["rng"] = checkpoint.load_sharded(path, raw_model, optimizer)
        else:
            optim.load_state(optimizer, resume_state["optimizer"])
        if resume_state.get("scaler"):
            scaler.load_state_dict(resume_state["scaler"])
        iter_num = resume_state["meta"]["iter_num"]
        best_val_loss = resume_state["meta"]["best_val_loss"]
        restore_rng(resume_state["rng"], rt, log)
        del resume_state

    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    log(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | {rt.world_size} process(es) on {rt.device} in {rt.dtype} "
        f"| {tokens_per_iter:,} tokens per iteration")
    jlog = rt.on_master(JsonLog, out_dir / "log.jsonl", iter_num if cfg.init_from == "resume" else None)
    wandb_run = rt.on_master(start_wandb, cfg) if cfg.wandb_log else None
    peak, peak_source = runtime.peak_flops_with_source(rt)
    log(f"MFU against {peak_source}")

    def write_log(record: dict, wandb_record: dict) -> None:
        jlog.write(record)
        if wandb_run:
            wandb_run.log(wandb_record)

    def save(reason: str, rng: dict) -> None:  # rank 0 only; with fsdp every rank writes its shards
        meta = {"iter_num": iter_num, "best_val_loss": best_val_loss, "model_args": dataclasses.asdict(raw_model.config),
                "config": configlib.to_dict(cfg), "tokenizer": tok_meta, "world_size": rt.world_size,
                "loader": {"seed": cfg.seed, "next_iter": iter_num}}
        try:
            if cfg.parallel == "fsdp":  # collective: every rank writes its shards
                path = checkpoint.save_sharded(out_dir, meta, raw_model, optimizer, rng)
            else:
                path = checkpoint.save_checkpoint(out_dir, meta, raw_model.state_dict(), optimizer.state_dict(),
                                                  scaler.state_dict(), rng)
        except OSError as e:
            raise UserError(f"could not save a checkpoint in {out_dir}: {e.strerror or e}; "
                            f"the previous checkpoint is intact") from None
        log(f"saved checkpoint at iter {iter_num} to {path} ({reason})")

    def save_everywhere(reason: str) -> None:
        """save() with every rank waiting for rank 0's write, and failing with it (fsdp: every rank writes)."""
        if not all_finite(raw_model, rt):
            raise UserError(f"the model has non-finite weights at iter {iter_num}; not saving over the last good "
                            f"checkpoint in {out_dir}")
        rng = gather_rng(rt)  # collective: every rank takes part
        if cfg.parallel == "fsdp":
            save(reason, rng)
        else:
            rt.on_master(save, reason, rng)

    stop = StopFlag()
    stop.install()
    stop_requested = False
    last_saved = iter_num if cfg.init_from == "resume" else -1
    batches = TrainBatches(data["train"], cfg, rt, accum)
    mfu_avg, steps_run = -1.0, 0
    while True:
        if stop_requested:
            save_everywhere(f"stopped by {stop.signal_name or 'a signal to another process'}")
            log(f"stopped at iter {iter_num}; continue with --init_from=resume --out_dir={out_dir}")
            return
        lr = get_lr(iter_num, cfg)
        optim.set_lr(optimizer, lr / cfg.learning_rate)

        want_save = bool(cfg.checkpoint_interval) and iter_num % cfg.checkpoint_interval == 0
        if iter_num % cfg.eval_interval == 0 or cfg.eval_only:
            losses = estimate_loss(model, data, cfg, rt)
            scores = evaluate.hellaswag_scores(raw_model, hellaswag, rt)  # {} without hellaswag_file
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                + "".join(f", {k} {v:.4f}" for k, v in scores.items()))
            rt.on_master(write_log, {"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr}
                         | scores,
                         {"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr}
                         | {k.replace("_", "/", 1): v for k, v in scores.items()})
            if cfg.eval_only:
                return
            want_save |= losses["val"] < best_val_loss or cfg.always_save_checkpoint
            best_val_loss = min(best_val_loss, losses["val"])
        if iter_num >= cfg.max_iters:
            want_save = True
        if want_save and iter_num > max(last_saved, 0):
            save_everywhere("end of training" if iter_num >= cfg.max_iters else "scheduled")
            last_saved = iter_num
        if iter_num >= cfg.max_iters:
            return

        t0 = time.perf_counter()  # after any eval or save: the step's time is the step's alone
        loss, stop_requested = iteration(model, optimizer, scaler, batches, cfg, rt, iter_num, accum, stop)
        dt = time.perf_counter() - t0
        iter_num += 1
        steps_run += 1

        if loss is not None:  # a logging iteration
            if peak and steps_run > 5:  # the first steps include warm-up and compilation
                mfu = raw_model.estimate_mfu(cfg.batch_size * accum, dt, peak)
                mfu_avg = mfu if mfu_avg < 0 else 0.9 * mfu_avg + 0.1 * mfu
            record = {"iter": iter_num - 1, "loss": loss, "lr": lr, "ms": dt * 1000,
                      "tok_per_s": tokens_per_iter / dt, "mfu": mfu_avg if mfu_avg >= 0 else None}
            mfu_text = f", mfu {mfu_avg * 100:.2f}%" if mfu_avg >= 0 else ""
            log(f"iter {iter_num - 1}: loss {loss:.4f}, lr {lr:.2e}, time {dt * 1000:.1f}ms, "
                f"{tokens_per_iter / dt:,.0f} tok/s{mfu_text}")
            rt.on_master(write_log, record, {"iter": iter_num - 1, "train/loss_step": loss, "lr": lr,
                                             "mfu": record["mfu"]})


def iteration(model, optimizer, scaler, batches: "TrainBatches", cfg: TrainConfig, rt: runtime.Runtime, iter_num: int,
              accum: int, stop: StopFlag) -> tuple[float | None, bool]:
    """One training step at the set learning rate: forward and backward, the non-finite guard, the update.

    Returns the global mean loss on logging iterations (None on the others) and whether any rank
    was asked to stop. The one host sync per step is the guard's: it must see this step's loss
    before its update. The next step's first batch is already on its way (TrainBatches), and the
    stop flags travel on a host-side group, so the device is not left waiting.
    """
    loss_sum = train_step(model, scaler, batches, rt, iter_num, accum)
    finite = math.isfinite(loss_sum.item())
    stop_requested, any_bad = rt.any_rank(stop.signal_name is not None, not finite)
    logging = (iter_num + 1) % cfg.log_interval == 0
    loss = global_mean(loss_sum, rt) if any_bad or logging else None  # a device collective: only when used
    if any_bad:
        raise UserError(f"loss is {loss} at iter {iter_num}; stopped before the optimizer step, the last "
                        f"checkpoint in {cfg.out_dir} is untouched. Lower learning_rate or check the data")
    optimizer_step(model, optimizer, scaler, cfg)
    return loss, stop_requested


def start_wandb(cfg: TrainConfig):
    try:
        import wandb  # optional dependency, only when asked for
    except ImportError:
        raise UserError("wandb_log=True needs wandb: pip install wandb (or set --wandb_log=False)") from None
    return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=configlib.to_dict(cfg))


def global_mean(loss_sum: torch.Tensor, rt: runtime.Runtime) -> float:
    """The mean of every rank's loss_sum (each already averaged over its micro-steps)."""
    if rt.ddp:
        loss_sum = loss_sum.clone()
        dist.all_reduce(loss_sum)
    return loss_sum.item() / rt.world_size


class TrainBatches:
    """The training micro-batches in order, each fetched (and on CUDA copied asynchronously) while
    the previous one computes, across iterations too.

    Micro-batch g of the global batch (g = rank * accum + micro) is drawn from (seed, iter, g)
    alone, so the global batch does not depend on how many processes share it, and a resumed run
    reads exactly the batches the first run would have.
    """

    def __init__(self, data: TokenData, cfg: TrainConfig, rt: runtime.Runtime, accum: int):
        self.data, self.cfg, self.rt, self.accum = data, cfg, rt, accum
        self.ahead = None  # ((iter_num, micro), (x, y))

    def get(self, iter_num: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (iter_num, micro)
        if self.ahead is not None and self.ahead[0] == key:
            return self.ahead[1]
        return self._fetch(key)

    def prefetch_after(self, iter_num: int, micro: int) -> None:
        key = (iter_num, micro + 1) if micro + 1 < self.accum else (iter_num + 1, 0)
        self.ahead = (key, self._fetch(key))

    def _fetch(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        iter_num, micro = key
        gen = batch_generator(self.cfg.seed, "train", iter_num, self.rt.rank * self.accum + micro)
        return self.data.get_batch(self.cfg.batch_size, gen, self.rt.device)


def train_step(model, scaler, batches: TrainBatches, rt: runtime.Runtime, iter_num: int,
               accum: int) -> torch.Tensor:
    """Forward and backward over this process's micro-batches; returns its mean loss (on the device)."""
    loss_sum = None
    for micro in range(accum):
        x, y = batches.get(iter_num, micro)
        # Gradients are reduced once, on the last micro-step.
        with parallel.micro_step(model, rt, batches.cfg.parallel, last=micro == accum - 1):
            with rt.autocast():
                # Only the loss is kept: holding the logits too would keep a (B, T, vocab) tensor
                # alive through backward (1.2 GB for GPT-2 at 12 x 1024 in bfloat16).
                loss = model(x, y)[1] / accum
            batches.prefetch_after(iter_num, micro)  # read the next batch while the device works
            scaler.scale(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum


def optimizer_step(model, optimizer, scaler, cfg: TrainConfig) -> None:
    if cfg.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    run_cli(main)
