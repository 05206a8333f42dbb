"""Evaluate a checkpoint or GPT-2 weights: perplexity on every token of a split, or HellaSwag.

    python eval.py --out_dir=out-shakespeare-char-cpu                       # val split of the run's data_dir
    python eval.py --out_dir=out-shakespeare-char-cpu --stride=32           # sliding window: more context per token
    python eval.py --init_from=gpt2 --data_dir=data/fineweb --split=val     # GPT-2 weights (from the hub)
    python eval.py --init_from=gpt2 --task=hellaswag                        # after data/hellaswag/prepare.py
    python eval.py --out_dir=out-sft-tasks-char --task=chat --chat_file=data/chat/tasks_heldout.jsonl  # exact answers
    torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2-xl --task=hellaswag   # split across ranks

Perplexity scores each token once, in a fixed order (core/evaluate.py explains the windows), so
two runs evaluated on the same split and block_size compare directly. On a chat dataset
(data/chat/prepare.py) it scores the assistant's tokens only, each conversation read from its start.
--task=chat replies greedily to each conversation of a JSONL file and counts exact answers. The result is one line on
stdout; what was loaded goes to stderr.
"""
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from core import evaluate, runtime, weights
from core.chat import ChatTemplate
from core.config import parse_args
from core.data import TokenData, read_meta
from core.errors import UserError, run_cli
from core.tokenizer import check_same_tokenizer

TASKS = ("perplexity", "hellaswag", "chat")


@dataclasses.dataclass
class EvalConfig:
    init_from: str = "resume"        # 'resume' (out_dir/ckpt.pt), a GPT-2 name, or a transformers folder
    out_dir: str = "out"             # where init_from=resume finds ckpt.pt and config.json
    task: str = "perplexity"         # perplexity | hellaswag | chat
    data_dir: str | None = None      # perplexity: a prepared dataset; None: the run's own (out_dir/config.json)
    split: str = "val"
    block_size: int | None = None    # window length; None: the model's block_size
    stride: int | None = None        # a new window every stride tokens; None: block_size (non-overlapping)
    batch_size: int = 8              # windows per forward
    hellaswag_file: str = "data/hellaswag/hellaswag_val.jsonl"
    max_examples: int = 0            # hellaswag, chat: the first N examples only; 0: all
    chat_file: str = "data/chat/tasks_heldout.jsonl"  # chat: conversations whose last turn is the expected answer
    device: str = "auto"
    dtype: str = "auto"

    def validate(self) -> None:
        if self.task not in TASKS:
            raise UserError(f"task must be one of {', '.join(TASKS)}, got '{self.task}'")
        for key in ("block_size", "stride", "batch_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise UserError(f"{key} must be at least 1, got {value}")
        if self.max_examples < 0:
            raise UserError(f"max_examples must be >= 0 (0: all), got {self.max_examples}")
        weights.check_init_from(self.init_from)


def run_data_dir(cfg: EvalConfig) -> str:
    """--data_dir, else the data_dir the checkpoint's run trained on."""
    if cfg.data_dir is not None:
        return cfg.data_dir
    config_path = Path(cfg.out_dir) / "config.json"
    if cfg.init_from == "resume" and config_path.is_file():
        try:
            return json.loads(config_path.read_text())["data_dir"]
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    raise UserError("no dataset to evaluate on: pass --data_dir=data/<name> (a folder prepared by its prepare.py)")


class Progress:
    """Prints how far a long evaluation has got to stderr, about every 10 seconds."""

    def __init__(self, every_s: float = 10.0):
        self.every_s, self.last = every_s, time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            print(f"  ~{done / total:.0%} of {total:,} windows", file=sys.stderr)


def perplexity(cfg: EvalConfig, model, tok, rt: runtime.Runtime) -> str:
    data_dir = run_data_dir(cfg)
    check_same_tokenizer(tok.meta(), read_meta(data_dir), data_dir)
    block_size = cfg.block_size or model.config.block_size
    if block_size > model.config.block_size:
        raise UserError(f"block_size {block_size} is larger than the model's {model.config.block_size}")
    data = TokenData(data_dir, cfg.split, block_size, model.config.vocab_size)
    stride = cfg.stride or block_size
    if stride > block_size:
        raise UserError(f"stride {stride} is larger than block_size {block_size}; windows would skip tokens")
    r = evaluate.evaluate_split(model, data, stride, cfg.batch_size, rt.device, rt.autocast, rt.rank, rt.world_size,
                                progress=Progress() if rt.is_master else None)
    scored = "assistant tokens, each conversation from its start" if data.starts is not None else "tokens"
    return (f"{data_dir} {cfg.split}: loss {r.loss:.4f} | perplexity {r.perplexity:.3f} | {r.tokens:,} {scored} "
            f"(block_size {block_size}, stride {stride})")


def hellaswag(cfg: EvalConfig, model, tok, rt: runtime.Runtime, examples) -> str:
    rendered = evaluate.render_examples(examples, tok, model.config.block_size)
    r = evaluate.evaluate_hellaswag(model, rendered, rt.device, rt.autocast, rt.rank, rt.world_size)
    return (f"hellaswag {cfg.hellaswag_file}: acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f} | "
            f"{r['examples']} examples")


def chat(cfg: EvalConfig, model, tok, conversations) -> str:
    template = ChatTemplate.for_tokenizer(tok)
    if template is None:
        raise UserError("this model's tokenizer has no chat tokens (a base model): --task=chat needs a chat "
                        "fine-tune (docs/chat.md)")
    r = evaluate.chat_accuracy(model, template, conversations)
    return f"chat {cfg.chat_file}: exact-answer accuracy {r['accuracy']:.4f} ({r['correct']}/{r['examples']})"


def main(argv: Sequence[str]) -> str:
    cfg = parse_args(EvalConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype)
    try:
        # A missing or malformed file is found before the model is loaded.
        examples = evaluate.load_hellaswag(cfg.hellaswag_file, cfg.max_examples) if cfg.task == "hellaswag" else None
        if cfg.task == "chat":
            examples = evaluate.load_chat_file(cfg.chat_file, cfg.max_examples)
        model, tok, source = weights.load_model(cfg.init_from, cfg.out_dir)
        if rt.is_master:
            print(f"evaluating {source} on {rt.device} in {rt.dtype}", file=sys.stderr)
        model.to(rt.device)
        if cfg.task == "perplexity":
            line = perplexity(cfg, model, tok, rt)
        elif cfg.task == "chat":
            line = chat(cfg, model, tok, examples)
        else:
            line = hellaswag(cfg, model, tok, rt, examples)
        if rt.is_master:
            print(line)
        return line
    finally:
        runtime.teardown(rt)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run_cli(main)
