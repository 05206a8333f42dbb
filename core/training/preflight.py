"""Pre-flight: train.py's and rl.py's checks before a run trains (each a one-line UserError) and the notes they print:
out_dir, then the weights between the resolver's two steps, so a run that cannot work stops in seconds. No writes.
"""
import dataclasses
import math
import os
from pathlib import Path

from core.data.tokenizer import check_extends, check_same_ids, check_same_tokenizer, tokenizer_from_meta, tokenizer_meta
from core.errors import UserError
from core.runtime import Runtime
from core.training import memory
from core.training.runlog import format_duration
from core.training.train_config import ARCHITECTURE_KEYS, TrainConfig, local_accum_steps
from core.weights import checkpoint, hf, resolver
from model import GPT, GPTConfig


# -----------------------------------------------------------------------------
# out_dir, before any work


def check_ranks_agree(cfg: TrainConfig, rt: Runtime) -> None:
    """Every rank read out_dir on its own (loop.parse_config) before the process group existed: one that
    resumes beside one that starts afresh would train different iterations and hang or diverge. They agree
    when out_dir is one shared directory, as a resume needs; nothing writes a checkpoint before this check."""
    resuming = resolver.kind_of(cfg.init_from) == "resume"
    some, not_all = rt.any_rank(resuming, not resuming)
    if some and not_all:
        raise UserError(f"out_dir '{cfg.out_dir}' holds a checkpoint on some ranks and not on others; every "
                        f"process must see the same out_dir (a directory all nodes share)")


def check_out_dir(cfg) -> Path:
    """out_dir (train.py's or rl.py's), checked without writing to it: writable (found now, not at the first
    checkpoint), and, for a new run, not holding another run's checkpoint unless overwrite=True."""
    out_dir = Path(cfg.out_dir)
    existing = next((p for p in (out_dir, *out_dir.parents) if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = ("Not a directory" if not existing.is_dir() else
               "Read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "Permission denied")
        raise UserError(f"cannot write to out_dir '{out_dir}': {why}; choose a writable --out_dir")
    new_run = resolver.kind_of(cfg.init_from) != "resume" and not getattr(cfg, "eval_only", False)  # saves nothing
    found = checkpoint.find_checkpoint(out_dir) if new_run and not cfg.overwrite else None
    if found is not None:
        raise UserError(f"{out_dir} already holds a run's checkpoint ({describe_checkpoint(found)}); continue it "
                        f"with --init_from=resume, replace it with --overwrite=True, or choose another --out_dir")
    return out_dir


def describe_checkpoint(path: Path) -> str:
    """'iter N, val loss X' from a checkpoint's metadata, for the refusal to overwrite it."""
    try:
        meta = checkpoint.read_sharded_meta(path) if path.is_dir() else checkpoint.load_checkpoint(path)["meta"]
    except UserError as e:
        return f"{path.name}, unreadable: {e}"
    loss = meta.get("best_val_loss")
    loss_text = f"best val loss {loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "no val loss yet"
    return f"{path.name} at iter {meta.get('iter_num')}, {loss_text}"


# -----------------------------------------------------------------------------
# the weights a run starts from, between locating and building them


def check_weights(cfg: TrainConfig, w: resolver.Weights, data_meta: dict, rt: Runtime, log) -> None:
    """What init_from located (resolver.locate), checked against the run before any weight is read or allocated:
    so a run that plainly does not fit in memory stops first."""
    if w.kind == "resume":
        check_resume(cfg, w, data_meta, rt, log)
    elif w.kind == "run":  # a base run: its weights, a new run (e.g. a chat fine-tune)
        check_extends(w.tokenizer_meta, tokenizer_meta(data_meta), f"init_from={cfg.init_from}")
    elif w.kind == "folder":  # GPT-2, Llama, Qwen3, ...: its tokenizer must give the dataset's ids the same text
        data_tok = tokenizer_from_meta(data_meta, source=f"{cfg.data_dir}/meta.json")
        check_same_ids(w.tokenizer, data_tok, f"the tokenizer of {cfg.init_from}", f"the dataset in {cfg.data_dir}")
    check_memory(dataclasses.replace(w.config, block_size=min(cfg.block_size, w.config.block_size)), cfg, rt)


def check_resume(cfg: TrainConfig, w: resolver.Weights, data_meta: dict, rt: Runtime, log) -> None:
    """A resumed run continues the run it resumes: the same architecture, tokenizer and a block that fits."""
    saved = w.state["meta"]
    log(f"resuming from {w.path} at iter {saved['iter_num']}")
    saved_world = saved.get("world_size", rt.world_size)
    if saved_world != rt.world_size:
        log(f"note: the checkpoint was saved by {saved_world} process(es) and resumes on {rt.world_size}: "
            f"the same global batch ({cfg.gradient_accumulation_steps} micro-batches) split differently, so "
            f"losses match the uninterrupted run to float rounding, not bit for bit")
    for key, mine, theirs in _shapes(cfg, w.config):
        if mine is not None and mine != theirs:
            raise UserError(f"config {key}={mine} differs from the checkpoint's {theirs}; resume with the "
                            "config the run started with, or use a new out_dir")
    if cfg.block_size > (saved_block := saved["model_args"]["block_size"]):
        raise UserError(f"block_size {cfg.block_size} is larger than the checkpoint's {saved_block}; "
                        f"resume with --block_size={saved_block} or smaller")
    check_same_tokenizer(w.tokenizer_meta, data_meta, cfg.data_dir)


def check_gpt2(cfg: TrainConfig, data_meta: dict) -> None:
    """GPT-2's weights fine-tune on GPT-2's BPE, in GPT-2's architecture."""
    if data_meta.get("tokenizer") != "gpt2":
        raise UserError(f"init_from={cfg.init_from} needs a dataset tokenized with GPT-2's BPE, but "
                        f"{cfg.data_dir} uses {data_meta.get('tokenizer')!r}")
    switched = hf.non_gpt2_fields(GPTConfig(**cfg.model_args()))
    if switched:
        raise UserError(f"init_from={cfg.init_from} loads GPT-2's architecture, which has none of "
                        f"{', '.join(switched)}; drop those settings (or config/modern.py) to fine-tune it")


def check_memory(config: GPTConfig, cfg: TrainConfig, rt: Runtime) -> None:
    """One line, before any allocation, when weights, optimizer and activations plainly exceed free memory."""
    est = memory.estimate_training_memory(config, cfg.batch_size, cfg.optimizer, compute_dtype=rt.ptdtype,
                                          seq_len=cfg.block_size, shards=rt.world_size if cfg.parallel == "fsdp" else 1,
                                          micro_steps=local_accum_steps(cfg, rt.world_size),
                                          activation_checkpointing=cfg.activation_checkpointing)
    # Processes on one machine share its RAM; each GPU has its own memory.
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if rt.device_type == "cpu" else 1
    memory.check_fits(est, rt.device, sharing, f" for batch_size {cfg.batch_size} x block_size {cfg.block_size}")


def shape_set_aside(cfg: TrainConfig, config: GPTConfig) -> list[str]:
    """The architecture keys set away from TrainConfig's defaults that the weights' own shape (a folder's, the
    hub's, a base run's) overrides, as "key=mine (theirs)": a setting that does not apply is said, not dropped."""
    default = TrainConfig()
    return [f"{key}={mine!r} (the weights': {theirs!r})" for key, mine, theirs in _shapes(cfg, config)
            if getattr(cfg, key) not in (None, getattr(default, key)) and mine != theirs]


def _shapes(cfg: TrainConfig, config: GPTConfig):
    """(key, the config's setting, the weights') for each architecture key."""
    for key in ARCHITECTURE_KEYS:
        mine, theirs = getattr(cfg, key), getattr(config, key)
        if key == "n_kv_head":  # None and n_head are the same attention
            mine, theirs = mine or cfg.n_head, theirs or config.n_head
        yield key, mine, theirs


# -----------------------------------------------------------------------------
# notes the run prints


# A CPU run whose arithmetic alone, at the CPU's measured matmul peak, takes longer than this is sized for a GPU.
GPU_SIZED_S = 3600.0


def gpu_sized_note(model: GPT, cfg: TrainConfig, rt: Runtime, peak: float | None, iter_num: int) -> str | None:
    """One line for a run on a CPU that is sized for a GPU (config/train_shakespeare_char.py there): the time
    its FLOPs alone take at the CPU's peak, a lower bound of what it will take; None for a CPU-sized run."""
    if rt.device_type != "cpu" or not peak:
        return None
    per_token = model.flops_per_token() / peak  # seconds of a forward and backward, per token
    step_s = per_token * local_accum_steps(cfg, rt.world_size) * cfg.batch_size * cfg.block_size
    eval_s = per_token / 3 * 2 * -(-cfg.eval_iters // rt.world_size) * cfg.batch_size * cfg.block_size  # forwards
    left = cfg.max_iters - iter_num
    total_s = step_s * left + eval_s * (left // cfg.eval_interval + 1)
    if total_s < GPU_SIZED_S:
        return None
    return (f"note: this config is sized for a GPU: on this CPU each eval (2 x {cfg.eval_iters} batches of "
            f"{cfg.batch_size} x {cfg.block_size}) takes at least {format_duration(eval_s)}, the run at least "
            f"{format_duration(total_s)}; config/train_shakespeare_char_cpu.py is sized for a CPU")
