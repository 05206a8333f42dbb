"""Train a GPT: one process, or many under torchrun, through the same code path.

    python train.py config/train_shakespeare_char.py            # the baby GPT, one device
    python train.py config/train_shakespeare_char.py --device=cpu --max_iters=200
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py
    torchrun --nnodes=2 --node_rank=0 --rdzv_endpoint=HOST:29500 --nproc_per_node=8 train.py config/gpt2_small.py
    python train.py --init_from=resume --out_dir=out-shakespeare-char   # continue a run: its config.json, ckpt.pt
    torchrun --standalone --nproc_per_node=8 --max-restarts=3 train.py config/gpt2_small.py --init_from=auto
                                        # start, or continue after a restart, requeue or preemption (docs/training.md)
    python train.py config/train_shakespeare_char_cpu.py config/sft_tasks_char.py   # chat fine-tune of that base
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py --parallel=fsdp   # sharded: core/training/parallel.py

TrainConfig's defaults, then config files, then --key=value (a resume: its own config.json first); the result goes
to out_dir/config.json, every logged iteration and eval to log.jsonl. SIGTERM, SIGINT or SIGHUP (not under nohup)
finishes the step or eval batch, saves and exits 0; during start-up it stops, writing nothing (docs/training.md).
"""
from core.errors import Stopped, UserError, alike_on_every_rank, quiet_start, run_cli
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import dataclasses
import math
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from core import runtime
from core.data.loader import TokenData, TrainBatches, batch_generator, read_meta
from core.data.tokenizer import tokenizer_from_meta, tokenizer_meta
from core.evaluation.hellaswag import hellaswag_scores, load_hellaswag, render_examples
from core.evaluation.perplexity import evaluating
from core.training import checkpointing, loop, optim, parallel, preflight
from core.training.runlog import RunLog, format_duration
from core.training.train_config import ARCHITECTURE_KEYS, TrainConfig, get_lr, local_accum_steps, make_optimizer, seq_len_at
from core.weights import resolver
from model import GPT, GPT2_HUB_NAMES, GPTConfig


def main(argv) -> None:
    loop.start(TrainConfig, argv, train)  # the config (loop.parse_config), the runtime, then train()


def train(cfg: TrainConfig, rt: runtime.Runtime, stop: runtime.StopFlag) -> None:
    log = print if rt.is_master else (lambda *a, **k: None)
    starting = "before training started; nothing was written"  # what a signal during start-up leaves
    stop.check(starting)
    with alike_on_every_rank():
        preflight.check_ranks_agree(cfg, rt)  # init_from=auto: each decided alone
        accum = local_accum_steps(cfg, rt.world_size)
        out_dir = preflight.check_out_dir(cfg)
        data_meta = read_meta(cfg.data_dir)
    # The data first: a missing file or a block_size longer than the data is found in a second,
    # before a model of that block_size is built.
    data = {split: TokenData(cfg.data_dir, split, cfg.block_size, loss_mask=cfg.loss_mask) for split in ("train", "val")}
    torch.manual_seed(cfg.seed)  # the same initial weights on every process
    model, tok_meta, resumed = build_model(cfg, data_meta, rt, log)  # resumed: the Weights of a resume, else None
    resuming = resumed is not None  # the resolver's answer: init_from named this run's own checkpoint
    # A model from weights (a folder, the hub, a base run) has their shape, not the config's: config.json
    # records that, so `--init_from=resume --out_dir=RUN` resumes with the shape the checkpoint holds.
    if not resuming and (replaced := preflight.shape_set_aside(cfg, model.config)):
        log(f"note: init_from={cfg.init_from} brings its own architecture; not applied: {', '.join(replaced)}")
    cfg = dataclasses.replace(cfg, **{k: getattr(model.config, k) for k in ARCHITECTURE_KEYS})
    stop.check(starting)
    # Then dropout masks of their own per rank (batches come from their own generators, never from this).
    torch.manual_seed(cfg.seed + rt.rank)
    hellaswag = None if cfg.hellaswag_file is None else render_examples(
        load_hellaswag(cfg.hellaswag_file), tokenizer_from_meta(tok_meta), model.config.block_size)
    model.to(rt.device)
    raw_model = model  # what is saved: never the compiled or DDP-wrapped module (fsdp shards it in place)
    compile = cfg.compile if cfg.compile is not None else rt.device_type == "cuda"
    model = parallel.parallelize(raw_model, rt, cfg.parallel, cfg.activation_checkpointing, compile)
    optimizer = make_optimizer(raw_model, cfg, rt.device_type)  # after sharding: fsdp replaces the parameters
    scaler = rt.grad_scaler()
    iter_num, best_val_loss = (checkpointing.restore(resumed, raw_model, optimizer, scaler, rt, log) if resuming
                               else (0, float("inf")))
    del resumed

    stop.check(starting)
    loop.write_run_config(cfg, out_dir, rt)  # the run starts: nothing was written before this point
    rows = cfg.gradient_accumulation_steps * cfg.batch_size  # sequences per iteration, all processes together
    warmup = (f" (from {rows * seq_len_at(0, cfg):,} over a {cfg.seq_len_warmup_iters}-iteration sequence-length "
              f"warm-up)" if cfg.seq_len_warmup_iters else "")
    log(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | {rt.world_size} process(es) on {rt.device} in "
        f"{rt.dtype} | {rows * cfg.block_size:,} tokens per iteration{warmup}")
    runlog = RunLog(out_dir / "log.jsonl", rt, iter_num if resuming else None,
                    dataclasses.asdict(cfg) if cfg.wandb_log else None)
    peak, peak_source = runtime.peak_flops_with_source(rt)
    log(f"MFU against {peak_source}")
    if note := preflight.gpu_sized_note(raw_model, cfg, rt, peak, iter_num):
        log(note)
    batches = TrainBatches(data["train"], cfg.seed, cfg.batch_size, accum, rt.rank, rt.device,
                           seq_len=lambda it: seq_len_at(it, cfg))
    stop.message = "stopping after this batch; saving"
    stop_requested, last_saved = False, iter_num if resuming else -1
    mfu_avg, steps_run, loop_start = -1.0, 0, time.perf_counter()

    # What the loop does besides the step, over its own state (iter_num, best_val_loss, steps_run).
    def stopped() -> bool:  # every rank calls it at the same eval batches
        return rt.any_rank(stop.requested)[0]

    def eta() -> str:  # the rest of the run at this launch's pace so far, evals and saves included
        per_step = (time.perf_counter() - loop_start) / max(steps_run, 1)
        return format_duration(per_step * (cfg.max_iters - iter_num))

    def finish(how: str) -> None:
        best = f"best val loss {best_val_loss:.4f}" if math.isfinite(best_val_loss) else "no val loss yet"
        log(f"{how} at iter {iter_num}/{cfg.max_iters} after {format_duration(runlog.elapsed())} of training (this "
            f"launch: {steps_run} iterations in {format_duration(time.perf_counter() - loop_start)}); {best}")

    def save(reason: str) -> None:  # every rank calls it
        meta = {"iter_num": iter_num, "best_val_loss": best_val_loss,
                "model_args": dataclasses.asdict(raw_model.config), "config": dataclasses.asdict(cfg),
                "tokenizer": tok_meta, "world_size": rt.world_size, "loader": {"seed": cfg.seed, "next_iter": iter_num}}
        path = checkpointing.save(out_dir, meta, raw_model, optimizer, scaler, rt, sharded=cfg.parallel == "fsdp")
        log(f"saved checkpoint at iter {iter_num} to {path} ({reason})")

    while True:
        if stop_requested:
            save(f"stopped by {stop.signal_name or 'a signal to another process'}")
            finish("stopped")
            log(f"stopped at iter {iter_num}; continue with: {loop.resume_command(out_dir, rt)}")
            return
        lr = get_lr(iter_num, cfg)
        optim.set_lr(optimizer, lr / cfg.learning_rate)

        # evaluate and save between steps
        want_save = bool(cfg.checkpoint_interval) and iter_num % cfg.checkpoint_interval == 0
        if iter_num % cfg.eval_interval == 0 or cfg.eval_only:
            losses = estimate_loss(model, data, cfg, rt, stopped)
            scores = None if losses is None else hellaswag_scores(raw_model, hellaswag, rt, stopped)
            if scores is None:  # a signal during the eval: save the last completed step, unevaluated
                if cfg.eval_only:
                    raise Stopped(stop.signal_name or "a signal to another process", "during the eval; no result")
                stop_requested = True
                continue
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
            finish("done")
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
        # Read before the update, where the guard waits for the device anyway: read after it, the host would wait
        # for the optimizer step too and leave the device idle until the next launches.
        logging = (iter_num + 1) % cfg.log_interval == 0
        loss = loop.global_mean(loss_sum, rt) if logging else None  # a device collective: only when used
        # the guard (a non-finite loss stops the run before the update), clip, step, zero the gradients
        stop_requested = loop.optimizer_step(model, optimizer, scaler, loss_sum, cfg, rt, stop, iter_num)
        dt = time.perf_counter() - t0
        seq_len = seq_len_at(iter_num, cfg)  # block_size, or shorter during the sequence-length warm-up
        iter_tokens = rows * seq_len
        iter_num += 1
        steps_run += 1

        if logging:
            if peak and steps_run > 5:  # the first steps include warm-up and compilation
                # the iteration's tokens as whole windows (attention counted at block_size: a little high
                # during a sequence-length warm-up)
                mfu = raw_model.estimate_mfu(cfg.batch_size * accum * seq_len / cfg.block_size, dt, peak)
                mfu_avg = mfu if mfu_avg < 0 else 0.9 * mfu_avg + 0.1 * mfu
            log(f"iter {iter_num - 1}/{cfg.max_iters}: loss {loss:.4f}, lr {lr:.2e}, time {dt * 1000:.1f}ms, "
                f"{iter_tokens / dt:,.0f} tok/s" + (f", mfu {mfu_avg * 100:.2f}%" if mfu_avg >= 0 else "")
                + f" | elapsed {format_duration(runlog.elapsed())}, eta {eta()}")
            # on CUDA the peak memory so far: an allocator count kept on the host, no sync
            memory = {"peak_mib": torch.cuda.max_memory_allocated(rt.device) / 2**20} if rt.device_type == "cuda" else {}
            runlog.write({"iter": iter_num - 1, "loss": loss, "lr": lr, "ms": dt * 1000,
                          "tok_per_s": iter_tokens / dt, "mfu": mfu_avg if mfu_avg >= 0 else None} | memory)


# -----------------------------------------------------------------------------
# what train() calls, in the order it calls it


def build_model(cfg: TrainConfig, data_meta: dict, rt: runtime.Runtime,
                log) -> tuple[GPT, dict, resolver.Weights | None]:
    """The model for cfg.init_from, the pre-flight checks between the resolver's two steps -> (model, the tokenizer
    metadata it is trained with, and for init_from=resume the checkpoint it resumes)."""
    data_vocab = data_meta.get("vocab_size")
    if not isinstance(data_vocab, int):
        raise UserError(f"{cfg.data_dir}/meta.json has no integer vocab_size; re-run the dataset's prepare.py")
    overrides = {"dropout": cfg.dropout, "attn_backend": cfg.attn_backend}
    if cfg.init_from == "scratch":
        w = resolver.Weights("scratch", scratch_config(cfg, data_meta), "scratch", overrides=overrides)
    else:
        if cfg.init_from in GPT2_HUB_NAMES:  # refused before the hub is asked: offline, its error would come first
            preflight.check_gpt2(cfg, data_meta)
        w = resolver.locate(cfg.init_from, cfg.out_dir, overrides, training=True, sharded=cfg.parallel == "fsdp",
                            log=log)
    preflight.check_weights(cfg, w, data_meta, rt, log)
    model = resolver.build(w)
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
    return (model, w.tokenizer_meta, w) if w.kind == "resume" else (model, tokenizer_meta(data_meta), None)


def scratch_config(cfg: TrainConfig, data_meta: dict) -> GPTConfig:
    return GPTConfig(**(cfg.model_args() | {"vocab_size": cfg.vocab_size or data_meta["vocab_size"]}))


@evaluating
def estimate_loss(model, data: dict[str, TokenData], cfg: TrainConfig, rt: runtime.Runtime,
                  stopped=None) -> dict[str, float] | None:
    """Mean loss over eval_iters fixed batches per split, shared among the processes; None if stopped() said so. The
    batches' own generators leave training's batches as they are and make every eval's numbers comparable."""
    out = {}
    # A bar on rank 0 for an eval that takes more than a few seconds (a GPU config on a CPU: minutes).
    padded = -(-cfg.eval_iters // rt.world_size) * rt.world_size  # batches per split, a multiple of world_size
    with tqdm(total=len(data) * padded, desc="eval", unit=" batches", delay=5.0, leave=False,
              disable=not rt.is_master, file=sys.stderr) as bar:
        for split, ds in data.items():
            total = torch.zeros(2, device=rt.device)  # (sum of losses, count)
            # Every rank runs as many forwards (padded): under fsdp each one is a collective (its all-gathers).
            for k in range(rt.rank, padded, rt.world_size):
                if stopped is not None and stopped():
                    return None
                gen = batch_generator(cfg.seed, "eval", split, k % cfg.eval_iters)
                x, y = ds.get_batch(cfg.batch_size, gen, rt.device)
                with rt.autocast():
                    _, loss = model(x, y)
                if k < cfg.eval_iters:
                    total += torch.stack([loss.float(), torch.ones((), device=rt.device)])
                bar.update(rt.world_size)  # every rank's batch of this round
            if rt.distributed:
                dist.all_reduce(total)
            out[split] = (total[0] / total[1]).item()
    return out


if __name__ == "__main__":
    run_cli(main)
