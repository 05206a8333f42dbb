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

from core import checkpoint, config as configlib, parallel, runtime
from core.data import TokenData, batch_generator, read_meta
from core.errors import UserError, first_line, run_cli
from core.fileio import atomic_path, write_json
from model import GPT, GPTConfig

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout", "attn_backend")


@dataclasses.dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 2000
    log_interval: int = 1
    eval_iters: int = 200
    eval_only: bool = False
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
        if not 0 < self.learning_rate < math.inf or not 0 <= self.min_lr <= self.learning_rate:
            raise UserError(f"need 0 < learning_rate and 0 <= min_lr <= learning_rate, got {self.learning_rate}, {self.min_lr}")
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
    return {k: meta[k] for k in ("tokenizer", "vocab_size", "itos", "stoi", "eot_token") if k in meta}


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


def build_model(cfg: TrainConfig, data_meta: dict, resume_state: dict | None) -> tuple[GPT, dict]:
    """The model for cfg.init_from, and the tokenizer metadata it is trained with."""
    if resume_state is not None:
        saved = resume_state["meta"]
        margs = saved["model_args"]
        for key in ("n_layer", "n_head", "n_embd", "bias", "vocab_size"):
            mine = getattr(cfg, key)
            if mine is not None and mine != margs[key]:
                raise UserError(f"config {key}={mine} differs from the checkpoint's {margs[key]}; resume with the "
                                "config the run started with, or use a new out_dir")
        if cfg.block_size > margs["block_size"]:
            raise UserError(f"block_size {cfg.block_size} is larger than the checkpoint's {margs['block_size']}; "
                            f"resume with --block_size={margs['block_size']} or smaller")
        model = checkpoint.model_from_checkpoint(resume_state, dropout=cfg.dropout, attn_backend=cfg.attn_backend)
        tok = saved["tokenizer"]
        check_same_tokenizer(tok, data_meta, cfg.data_dir)
    elif cfg.init_from == "scratch":
        vocab = cfg.vocab_size or data_meta.get("vocab_size")
        if not isinstance(vocab, int):
            raise UserError(f"{cfg.data_dir}/meta.json has no integer vocab_size; re-run the dataset's prepare.py")
        margs = {k: getattr(cfg, k) for k in MODEL_KEYS if k != "vocab_size"} | {"vocab_size": vocab}
        model = GPT(GPTConfig(**margs))
        tok = tokenizer_meta(data_meta)
    else:  # GPT-2 weights from the hub or a save_pretrained directory
        if data_meta.get("tokenizer") != "gpt2":
            raise UserError(f"init_from={cfg.init_from} needs a dataset tokenized with GPT-2's BPE, but "
                            f"{cfg.data_dir} uses {data_meta.get('tokenizer')!r}")
        try:
            model = GPT.from_pretrained(cfg.init_from, {"dropout": cfg.dropout, "attn_backend": cfg.attn_backend})
        except (OSError, ValueError) as e:
            raise UserError(f"could not load GPT-2 weights '{cfg.init_from}': {first_line(e)}") from None
        tok = tokenizer_meta(data_meta)
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    elif cfg.block_size > model.config.block_size:
        raise UserError(f"block_size {cfg.block_size} is larger than the model's {model.config.block_size}")
    return model, tok


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
    if not rng or len(rng["cpu"]) != rt.world_size:
        log("note: the checkpoint's RNG states were saved with another number of processes; dropout draws are "
            "re-seeded (batches still follow seed and iteration exactly)")
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
    finally:
        runtime.teardown(rt)


def prepare_out_dir(cfg: TrainConfig, rt: runtime.Runtime) -> Path:
    """Create out_dir and write the resolved config, before any training: an unwritable
    directory is found now, not at the first checkpoint."""
    out_dir = Path(cfg.out_dir)
    if rt.is_master:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json(out_dir / "config.json", configlib.to_dict(cfg) | {"world_size": rt.world_size,
                                                                          "device": rt.device, "dtype": rt.dtype})
        except OSError as e:
            raise UserError(f"cannot write to out_dir '{out_dir}': {e.strerror}; choose a writable --out_dir") from None
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
    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model, tok_meta = build_model(cfg, data_meta, resume_state)
    data = {split: TokenData(cfg.data_dir, split, cfg.block_size, model.config.vocab_size) for split in ("train", "val")}
    model.to(rt.device)
    raw_model = model  # what is saved: never the compiled or DDP-wrapped module (fsdp shards it in place)
    compile = cfg.compile if cfg.compile is not None else rt.device_type == "cuda"
    model = parallel.parallelize(raw_model, rt, cfg.parallel, cfg.activation_checkpointing, compile)

    # built after sharding: fully_shard replaces the parameters with their shards
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=(rt.dtype == "float16"))
    iter_num, best_val_loss = 0, float("inf")
    if resume_state is not None:
        if resume_state["model"] is None:
            resume_state["rng"] = checkpoint.load_sharded(path, raw_model, optimizer)
        else:
            optimizer.load_state_dict(resume_state["optimizer"])
        if resume_state.get("scaler"):
            scaler.load_state_dict(resume_state["scaler"])
        iter_num = resume_state["meta"]["iter_num"]
        best_val_loss = resume_state["meta"]["best_val_loss"]
        restore_rng(resume_state["rng"], rt, log)
        del resume_state

    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    log(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | {rt.world_size} process(es) on {rt.device} in {rt.dtype} "
        f"| {tokens_per_iter:,} tokens per iteration")
    jlog = JsonLog(out_dir / "log.jsonl", iter_num if cfg.init_from == "resume" else None) if rt.is_master else None
    wandb_run = None
    if cfg.wandb_log and rt.is_master:
        try:
            import wandb  # optional dependency, only when asked for
        except ImportError:
            raise UserError("wandb_log=True needs wandb: pip install wandb (or set --wandb_log=False)") from None
        wandb_run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=configlib.to_dict(cfg))
    peak = runtime.peak_flops(rt)

    def save(reason: str) -> None:
        if not all_finite(raw_model, rt):
            raise UserError(f"the model has non-finite weights at iter {iter_num}; not saving over the last good "
                            f"checkpoint in {out_dir}")
        rng = gather_rng(rt)  # collective: every rank takes part
        if not rt.is_master and cfg.parallel == "ddp":
            return
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

    stop = StopFlag()
    stop.install()
    stop_requested = False
    last_saved = iter_num if cfg.init_from == "resume" else -1
    mfu_avg, steps_run, t0 = -1.0, 0, time.perf_counter()
    while True:
        if stop_requested:
            save(f"stopped by {stop.signal_name or 'a signal to another process'}")
            log(f"stopped at iter {iter_num}; continue with --init_from=resume --out_dir={out_dir}")
            return
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

        want_save = bool(cfg.checkpoint_interval) and iter_num % cfg.checkpoint_interval == 0
        if iter_num % cfg.eval_interval == 0 or cfg.eval_only:
            losses = estimate_loss(model, data, cfg, rt)
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if jlog:
                jlog.write({"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr})
            if wandb_run:
                wandb_run.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr})
            if cfg.eval_only:
                return
            want_save |= losses["val"] < best_val_loss or cfg.always_save_checkpoint
            best_val_loss = min(best_val_loss, losses["val"])
        if iter_num >= cfg.max_iters:
            want_save = True
        if want_save and iter_num > max(last_saved, 0):
            save("end of training" if iter_num >= cfg.max_iters else "scheduled")
            last_saved = iter_num
        if iter_num >= cfg.max_iters:
            return

        loss_sum = train_step(model, optimizer, scaler, data["train"], cfg, rt, iter_num, accum)
        # One collective per step: the global loss (for the log and the non-finite check)
        # and whether any process was asked to stop.
        flags = torch.stack([loss_sum.float(), torch.tensor(float(stop.signal_name is not None), device=rt.device)])
        if rt.ddp:
            dist.all_reduce(flags)
        loss, stop_requested = flags[0].item() / rt.world_size, flags[1].item() > 0
        if not math.isfinite(loss):
            raise UserError(f"loss is {loss} at iter {iter_num}; stopped before the optimizer step, the last "
                            f"checkpoint in {out_dir} is untouched. Lower learning_rate or check the data")
        optimizer_step(model, optimizer, scaler, cfg)
        iter_num += 1
        steps_run += 1

        t1 = time.perf_counter()
        dt, t0 = t1 - t0, t1
        if iter_num % cfg.log_interval == 0 and rt.is_master:
            if peak and steps_run > 5:  # the first steps include warm-up and compilation
                mfu = raw_model.estimate_mfu(cfg.batch_size * accum, dt, peak)
                mfu_avg = mfu if mfu_avg < 0 else 0.9 * mfu_avg + 0.1 * mfu
            record = {"iter": iter_num - 1, "loss": loss, "lr": lr, "ms": dt * 1000,
                      "tok_per_s": tokens_per_iter / dt, "mfu": mfu_avg if mfu_avg >= 0 else None}
            mfu_text = f", mfu {mfu_avg * 100:.2f}%" if mfu_avg >= 0 else ""
            log(f"iter {iter_num - 1}: loss {loss:.4f}, lr {lr:.2e}, time {dt * 1000:.1f}ms, "
                f"{tokens_per_iter / dt:,.0f} tok/s{mfu_text}")
            jlog.write(record)
            if wandb_run:
                wandb_run.log({"iter": iter_num - 1, "train/loss_step": loss, "lr": lr, "mfu": record["mfu"]})


def train_step(model, optimizer, scaler, train_data: TokenData, cfg: TrainConfig, rt: runtime.Runtime,
               iter_num: int, accum: int) -> torch.Tensor:
    """Forward and backward over this process's micro-batches; returns its share of the loss.

    Micro-batch g of the global batch (g = rank * accum + micro) is drawn from
    (seed, iter, g) alone, so the global batch does not depend on how many processes
    share it, and a resumed run reads exactly the batches the first run would have.
    """
    def batch(micro: int):
        gen = batch_generator(cfg.seed, "train", iter_num, rt.rank * accum + micro)
        return train_data.get_batch(cfg.batch_size, gen, rt.device)

    loss_sum = torch.zeros((), device=rt.device)
    x, y = batch(0)
    for micro in range(accum):
        with parallel.micro_step(model, rt, cfg.parallel, last=micro == accum - 1):
            with rt.autocast():
                _, loss = model(x, y)
                loss = loss / accum
            if micro + 1 < accum:
                x, y = batch(micro + 1)  # prefetch while the device works
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
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
