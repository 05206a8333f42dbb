"""Train a GPT: one process, or many under torchrun, through the same code path.

    python train.py config/train_shakespeare_char.py            # the baby GPT, one device
    python train.py config/train_shakespeare_char.py --device=cpu --max_iters=200
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py
    torchrun --nnodes=2 --node_rank=0 --rdzv_endpoint=HOST:29500 --nproc_per_node=8 train.py config/gpt2_small.py
    python train.py config/train_shakespeare_char.py --init_from=resume   # continue from out_dir/ckpt.pt
    python train.py config/train_shakespeare_char_cpu.py config/sft_tasks_char.py   # chat fine-tune of that base
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py --parallel=fsdp   # sharded: core/parallel.py

Configuration: the TrainConfig defaults (core/train_config.py), overridden by config files (Python
files that assign names), overridden by --key=value. The resolved config is written
to out_dir/config.json, and every logged iteration and eval to out_dir/log.jsonl.

SIGTERM or SIGINT (Ctrl-C) finishes the current step, saves a checkpoint and exits 0.
"""
import dataclasses
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from core import checkpoint, config as configlib, evaluate, flops, memory, optim, parallel, runtime, weights
from core.data import TokenData, TrainBatches, batch_generator, read_meta
from core.errors import UserError, first_line, run_cli
from core.fileio import write_json
from core.runlog import RunLog
from core.tokenizer import check_extends, check_same_ids, check_same_tokenizer, tokenizer_from_meta, tokenizer_meta
from core.train_config import ARCHITECTURE_KEYS, TrainConfig, get_lr, local_accum_steps, make_optimizer
from model import GPT, GPTConfig


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


def train(cfg: TrainConfig, rt: runtime.Runtime) -> None:
    log = print if rt.is_master else (lambda *a, **k: None)
    accum = local_accum_steps(cfg, rt.world_size)
    out_dir = prepare_out_dir(cfg, rt)
    data_meta = read_meta(cfg.data_dir)
    # The data first: a missing file or a block_size longer than the data is found in a second,
    # before a model of that block_size is built.
    data = {split: TokenData(cfg.data_dir, split, cfg.block_size, loss_mask=cfg.loss_mask) for split in ("train", "val")}
    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model, tok_meta, resumed = build_model(cfg, data_meta, rt, log)  # resumed: None unless init_from=resume
    # Then dropout masks of their own per rank (batches come from their own generators, never from this).
    torch.manual_seed(cfg.seed + rt.rank)
    hellaswag = None if cfg.hellaswag_file is None else evaluate.render_examples(
        evaluate.load_hellaswag(cfg.hellaswag_file), tokenizer_from_meta(tok_meta), model.config.block_size)
    model.to(rt.device)
    raw_model = model  # what is saved: never the compiled or DDP-wrapped module (fsdp shards it in place)
    compile = cfg.compile if cfg.compile is not None else rt.device_type == "cuda"
    model = parallel.parallelize(raw_model, rt, cfg.parallel, cfg.activation_checkpointing, compile)
    optimizer = make_optimizer(raw_model, cfg, rt.device_type)  # after sharding: fsdp replaces the parameters
    scaler = rt.grad_scaler()
    iter_num, best_val_loss = 0, float("inf")
    if resumed is not None:
        iter_num, best_val_loss = restore_state(resumed.state, resumed.path, raw_model, optimizer, scaler, rt, log)
        del resumed

    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    log(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | {rt.world_size} process(es) on {rt.device} in "
        f"{rt.dtype} | {tokens_per_iter:,} tokens per iteration")
    runlog = RunLog(out_dir / "log.jsonl", rt, iter_num if cfg.init_from == "resume" else None,
                    configlib.to_dict(cfg) if cfg.wandb_log else None)
    peak, peak_source = flops.peak_flops_with_source(rt)
    log(f"MFU against {peak_source}")
    batches = TrainBatches(data["train"], cfg.seed, cfg.batch_size, accum, rt.rank, rt.device)
    stop = runtime.StopFlag()
    stop.install()
    stop_requested, last_saved = False, iter_num if cfg.init_from == "resume" else -1
    mfu_avg, steps_run = -1.0, 0

    def save(reason: str) -> None:  # every rank calls it
        meta = {"iter_num": iter_num, "best_val_loss": best_val_loss,
                "model_args": dataclasses.asdict(raw_model.config), "config": configlib.to_dict(cfg),
                "tokenizer": tok_meta, "world_size": rt.world_size, "loader": {"seed": cfg.seed, "next_iter": iter_num}}
        path = checkpoint.save(out_dir, meta, raw_model, optimizer, scaler, rt, sharded=cfg.parallel == "fsdp")
        log(f"saved checkpoint at iter {iter_num} to {path} ({reason})")

    while True:
        if stop_requested:
            save(f"stopped by {stop.signal_name or 'a signal to another process'}")
            log(f"stopped at iter {iter_num}; continue with --init_from=resume --out_dir={out_dir}")
            return
        lr = get_lr(iter_num, cfg)
        optim.set_lr(optimizer, lr / cfg.learning_rate)

        # evaluate and save between steps
        want_save = bool(cfg.checkpoint_interval) and iter_num % cfg.checkpoint_interval == 0
        if iter_num % cfg.eval_interval == 0 or cfg.eval_only:
            losses = estimate_loss(model, data, cfg, rt)
            scores = evaluate.hellaswag_scores(raw_model, hellaswag, rt)  # {} without hellaswag_file
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                + "".join(f", {k} {v:.4f}" for k, v in scores.items()))
            runlog.write({"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"], "lr": lr}
                         | scores)
            if cfg.eval_only:
                return
            want_save |= losses["val"] < best_val_loss or cfg.always_save_checkpoint
            best_val_loss = min(best_val_loss, losses["val"])
        if (want_save or iter_num >= cfg.max_iters) and iter_num > max(last_saved, 0):
            save("end of training" if iter_num >= cfg.max_iters else "scheduled")
            last_saved = iter_num
        if iter_num >= cfg.max_iters:
            return

        # the step: forward and backward over this process's micro-batches
        t0 = time.perf_counter()  # after any eval or save: the step's time is the step's alone
        loss_sum = 0.0  # becomes this process's mean loss, a tensor on the device
        for micro in range(accum):
            x, y = batches.get(iter_num, micro)
            # Gradients are reduced across processes once, on the last micro-step.
            with parallel.micro_step(model, rt, cfg.parallel, last=micro == accum - 1):
                with rt.autocast():
                    # Only the loss is kept: holding the logits too would keep a (B, T, vocab) tensor
                    # alive through backward (1.2 GB for GPT-2 at 12 x 1024 in bfloat16).
                    loss = model(x, y)[1] / accum
                batches.prefetch_after(iter_num, micro)  # read the next batch while the device works
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # The non-finite guard: the step's one host sync, since it must see this loss before the update.
        # The stop flags travel with it on a host-side group, so the device is not left waiting.
        stop_requested, any_bad = rt.any_rank(stop.signal_name is not None, not math.isfinite(loss_sum.item()))
        logging = (iter_num + 1) % cfg.log_interval == 0
        loss = global_mean(loss_sum, rt) if any_bad or logging else None  # a device collective: only when used
        if any_bad:
            raise UserError(f"loss is {loss} at iter {iter_num}; stopped before the optimizer step, the last "
                            f"checkpoint in {cfg.out_dir} is untouched. Lower learning_rate or check the data")
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        iter_num += 1
        steps_run += 1

        if logging:
            if peak and steps_run > 5:  # the first steps include warm-up and compilation
                mfu = raw_model.estimate_mfu(cfg.batch_size * accum, dt, peak)
                mfu_avg = mfu if mfu_avg < 0 else 0.9 * mfu_avg + 0.1 * mfu
            log(f"iter {iter_num - 1}: loss {loss:.4f}, lr {lr:.2e}, time {dt * 1000:.1f}ms, "
                f"{tokens_per_iter / dt:,.0f} tok/s" + (f", mfu {mfu_avg * 100:.2f}%" if mfu_avg >= 0 else ""))
            runlog.write({"iter": iter_num - 1, "loss": loss, "lr": lr, "ms": dt * 1000,
                          "tok_per_s": tokens_per_iter / dt, "mfu": mfu_avg if mfu_avg >= 0 else None})


# -----------------------------------------------------------------------------
# what train() calls, in the order it calls it


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


def build_model(cfg: TrainConfig, data_meta: dict, rt: runtime.Runtime,
                log) -> tuple[GPT, dict, weights.Weights | None]:
    """The model for cfg.init_from (core/weights.py), the tokenizer metadata it is trained with, and for
    init_from=resume the checkpoint it resumes (restore_state). The training checks run on the
    architecture before any weight is read, so a run that plainly does not fit in memory stops first."""

    def check(w: weights.Weights) -> None:
        if w.kind == "resume":
            check_resume(cfg, w, data_meta, rt, log)
        elif w.kind == "run":  # a base run: its weights, a new run (e.g. a chat fine-tune)
            check_extends(w.tokenizer_meta, tokenizer_meta(data_meta), f"init_from={cfg.init_from}")
        elif w.kind == "folder":  # GPT-2, Llama, Qwen3, ...: its tokenizer must give the dataset's ids the same text
            data_tok = tokenizer_from_meta(data_meta, source=f"{cfg.data_dir}/meta.json")
            check_same_ids(w.tokenizer, data_tok, f"the tokenizer of {cfg.init_from}", f"the dataset in {cfg.data_dir}")
        elif w.kind == "hub":
            check_gpt2(cfg, data_meta)
        check_memory(dataclasses.replace(w.config, block_size=min(cfg.block_size, w.config.block_size)), cfg, rt)

    training = weights.Training({"dropout": cfg.dropout, "attn_backend": cfg.attn_backend},
                                lambda: scratch_config(cfg, data_meta), check, cfg.parallel == "fsdp", log)
    w = weights.resolve(cfg.init_from, cfg.out_dir, training)
    model = w.model
    data_vocab = data_meta.get("vocab_size")
    if not isinstance(data_vocab, int):
        raise UserError(f"{cfg.data_dir}/meta.json has no integer vocab_size; re-run the dataset's prepare.py")
    if w.kind not in ("scratch", "resume") and data_meta.get("special_tokens"):
        # Fine-tuning on a chat set: ids past the model's rows are the chat tokens appended to its vocabulary.
        model.grow_vocab(max(data_vocab, model.config.vocab_size))
    if data_vocab > model.config.vocab_size:
        raise UserError(f"{cfg.data_dir}/meta.json has vocab_size {data_vocab}, larger than the model's vocab_size "
                        f"{model.config.vocab_size}; token ids would index past the embedding table")
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    elif cfg.block_size > model.config.block_size:
        raise UserError(f"block_size {cfg.block_size} is larger than the model's {model.config.block_size}")
    if w.kind == "resume":
        return model, w.tokenizer_meta, w
    return model, tokenizer_meta(data_meta), None


def scratch_config(cfg: TrainConfig, data_meta: dict) -> GPTConfig:
    vocab = cfg.vocab_size or data_meta.get("vocab_size")
    if not isinstance(vocab, int):
        raise UserError(f"{cfg.data_dir}/meta.json has no integer vocab_size; re-run the dataset's prepare.py")
    return GPTConfig(**(cfg.model_args() | {"vocab_size": vocab}))


def check_resume(cfg: TrainConfig, w: weights.Weights, data_meta: dict, rt: runtime.Runtime, log) -> None:
    """A resumed run continues the run it resumes: the same architecture, tokenizer and a block that fits."""
    saved = w.state["meta"]
    log(f"resuming from {w.path} at iter {saved['iter_num']}")
    saved_world = saved.get("world_size", rt.world_size)
    if saved_world != rt.world_size:
        log(f"note: the checkpoint was saved by {saved_world} process(es) and resumes on {rt.world_size}: "
            f"the same global batch ({cfg.gradient_accumulation_steps} micro-batches) split differently, so "
            f"losses match the uninterrupted run to float rounding, not bit for bit")
    margs = saved["model_args"]
    for key in ARCHITECTURE_KEYS:
        mine, theirs = getattr(cfg, key), getattr(w.config, key)
        if key == "n_kv_head":  # None and n_head are the same attention
            mine, theirs = mine or cfg.n_head, theirs or w.config.n_head
        if mine is not None and mine != theirs:
            raise UserError(f"config {key}={mine} differs from the checkpoint's {theirs}; resume with the "
                            "config the run started with, or use a new out_dir")
    if cfg.block_size > margs["block_size"]:
        raise UserError(f"block_size {cfg.block_size} is larger than the checkpoint's {margs['block_size']}; "
                        f"resume with --block_size={margs['block_size']} or smaller")
    check_same_tokenizer(w.tokenizer_meta, data_meta, cfg.data_dir)


def check_gpt2(cfg: TrainConfig, data_meta: dict) -> None:
    """GPT-2's weights fine-tune on GPT-2's BPE, in GPT-2's architecture."""
    if data_meta.get("tokenizer") != "gpt2":
        raise UserError(f"init_from={cfg.init_from} needs a dataset tokenized with GPT-2's BPE, but "
                        f"{cfg.data_dir} uses {data_meta.get('tokenizer')!r}")
    switched = GPTConfig(**cfg.model_args()).non_gpt2_fields()
    if switched:
        raise UserError(f"init_from={cfg.init_from} loads GPT-2's architecture, which has none of "
                        f"{', '.join(switched)}; drop those settings (or config/modern.py) to fine-tune it")


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


def restore_state(state: dict, path: Path, model: GPT, optimizer, scaler, rt: runtime.Runtime,
                  log) -> tuple[int, float]:
    """Load the optimizer, loss scaler and RNG states (and, for fsdp, the sharded weights) of the
    checkpoint being resumed; returns its (iter_num, best_val_loss)."""
    meta = state["meta"]
    if state["model"] is None:  # fsdp: every rank reads its own shards
        with optim.restoring(optimizer, meta["config"].get("optimizer", "adamw")):
            state["rng"] = checkpoint.load_sharded(path, model, optimizer)
    else:
        optim.load_state(optimizer, state["optimizer"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    checkpoint.restore_rng(state["rng"], rt, log)
    return meta["iter_num"], meta["best_val_loss"]


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


def global_mean(loss_sum: torch.Tensor, rt: runtime.Runtime) -> float:
    """The mean of every rank's loss_sum (each already averaged over its micro-steps)."""
    if rt.ddp:
        loss_sum = loss_sum.clone()
        dist.all_reduce(loss_sum)
    return loss_sum.item() / rt.world_size


if __name__ == "__main__":
    run_cli(main)
