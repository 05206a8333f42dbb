"""Evaluate a checkpoint or GPT-2 weights: perplexity on every token of a split, HellaSwag, or a chat model's answers.

    python eval.py --out_dir=out-shakespeare-char-cpu                       # val split of the run's data_dir
    python eval.py --out_dir=out-shakespeare-char-cpu --stride=32           # sliding window: more context per token
    python eval.py --init_from=gpt2 --data_dir=data/fineweb --split=val     # GPT-2 weights (from the hub)
    python eval.py --init_from=gpt2 --task=hellaswag                        # after data/hellaswag/prepare.py
    python eval.py --out_dir=out-sft-tasks-char --task=chat --chat_file=data/chat/tasks_heldout.jsonl  # exact answers
    python eval.py --out_dir=out-rl-tasks-char --task=reverse               # a task's 200 held-out problems, greedy
    python eval.py --out_dir=out-rl-tasks-char --task=reverse --samples=8 --temperature=1   # pass@1 to pass@8
    python eval.py --out_dir=out-rl-sort-char --task=sort --task_split=longer  # a checked task's longer problems
    torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2-xl --task=hellaswag   # split across ranks

Perplexity scores each token once, in a fixed order, so runs on the same split compare directly, and bits per byte
across tokenizers (docs/evaluation.md); a chat dataset scores only the assistant's tokens. --task=chat counts exact
greedy answers; --task=NAME scores a checked task's replies as rl.py does (docs/chat.md). The result is one line on
stdout; what was loaded goes to stderr.
"""
from core.errors import quiet_start
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from core import runtime
from core.config import at_least, parse_args
from core.data import tasks as tasklib
from core.data.chat import ChatTemplate
from core.data.loader import TokenData, read_meta
from core.data.tokenizer import check_same_tokenizer, token_bytes
from core.decoding.decode import inference_model
from core.decoding.quantize import check_quantize
from core.errors import Stopped, UserError, run_cli
from core.evaluation.answers import chat_accuracy, load_chat_file, task_scores
from core.evaluation.hellaswag import evaluate_hellaswag, load_hellaswag, render_examples
from core.evaluation.perplexity import evaluate_split
from core.weights import checkpoint, resolver

EVALUATIONS = ("perplexity", "hellaswag", "chat")  # and each task with a checker (core/data/tasks.py TASKS)


@dataclasses.dataclass
class EvalConfig:
    init_from: str = "resume"        # 'resume' (out_dir/ckpt.pt), a GPT-2 name, or a transformers folder
    out_dir: str = "out"             # where init_from=resume finds ckpt.pt
    task: str = "perplexity"         # perplexity | hellaswag | chat | a task with a checker: reverse, upper, add
    data_dir: str | None = None      # perplexity: a prepared dataset; None: the one the checkpoint's run trained on
    split: str = "val"
    block_size: int | None = None    # window length; None: the model's block_size
    stride: int | None = None        # a new window every stride tokens; None: block_size (non-overlapping)
    batch_size: int = 8              # windows per forward
    hellaswag_file: str = "data/hellaswag/hellaswag_val.jsonl"
    max_examples: int = 0            # hellaswag, chat: the first N examples only; 0: all
    chat_file: str = "data/chat/tasks_heldout.jsonl"  # chat: conversations whose last turn is the expected answer
    task_examples: int = 200         # a checked task: its first N problems of task_split (core/data/tasks.py)
    task_split: str = "heldout"      # a checked task: heldout, longer (sort, palindrome) or demos_heldout
    samples: int = 1                 # a checked task: replies per problem (pass@samples); more than 1 needs temperature
    temperature: float = 0.0         # a checked task: 0 is greedy
    max_new_tokens: int = 32         # a checked task: the longest reply
    seed: int = 0                    # a checked task: the replies' generators follow from it
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0                 # torch's CPU threads; 0: torch's default, one per core (docs/performance.md)
    quantize: str = "none"           # int8 | int4: the weights quantized once, CPU only (core/decoding/quantize.py)

    def validate(self) -> None:
        if self.task not in EVALUATIONS and self.task not in tasklib.TASKS:
            raise UserError(f"task must be one of {', '.join((*EVALUATIONS, *tasklib.TASKS))}, got '{self.task}'")
        at_least(self, 1, "block_size", "stride", "batch_size", "task_examples", "samples", "max_new_tokens")
        if self.max_examples < 0:
            raise UserError(f"max_examples must be >= 0 (0: all), got {self.max_examples}")
        if not 0 <= self.temperature < float("inf") or (self.samples > 1 and self.temperature == 0):
            raise UserError(f"temperature must be >= 0, and > 0 for more than one sample (greedy replies are all "
                            f"alike), got {self.temperature} with samples={self.samples}")
        resolver.check_init_from(self.init_from)


def run_data_dir(cfg: EvalConfig, w: resolver.Weights) -> str:
    """--data_dir, else the dataset the checkpoint's run trained on: its config's data_dir, or a nanoGPT run's
    data/<dataset> beside the run or under the working directory (as its vocabulary is found)."""
    if cfg.data_dir is not None:
        return cfg.data_dir
    run = (w.state or {}).get("meta", {}).get("config") or {}
    if "dataset" in run:  # nanoGPT's
        places = checkpoint.nanogpt_dataset_dirs(str(run["dataset"]), w.path)
    else:
        places = [Path(run["data_dir"])] if isinstance(run.get("data_dir"), str) else []
    found = next((p for p in places if p.is_dir()), None)
    if found is not None:
        return str(found)
    looked = f"{w.source}'s dataset is not at {' or '.join(map(str, places))}; " if places else ""
    raise UserError(f"no dataset to evaluate on: {looked}pass --data_dir=data/<name> (a folder prepared by its "
                    f"prepare.py)")


def result_or_stop(result, stop: runtime.StopFlag):
    """An evaluation's result, or Stopped when a signal ended it early (the evaluation returned None)."""
    if result is None:
        raise Stopped(stop.signal_name or "a signal to another process", "during the evaluation; no result")
    return result


def on_ranks(evaluate, unit: str, rt: runtime.Runtime, stop: runtime.StopFlag, *args, **kwargs):
    """evaluate(*args, **kwargs), split across the ranks and stopped on every rank alike, with a tqdm bar on stderr
    as its progress(done, total): rank 0's, and shown only for work past a few seconds (tqdm's delay)."""
    with tqdm(unit=f" {unit}", file=sys.stderr, delay=2.0, dynamic_ncols=True, disable=not rt.is_master) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        r = evaluate(*args, **kwargs, device=rt.device, autocast=rt.autocast, rank=rt.rank, world_size=rt.world_size,
                     progress=progress, stopped=lambda: rt.any_rank(stop.requested)[0])
    return result_or_stop(r, stop)


def perplexity(cfg: EvalConfig, model, tok, data_dir: str, rt: runtime.Runtime, stop: runtime.StopFlag) -> str:
    check_same_tokenizer(tok.meta(), read_meta(data_dir), data_dir)
    block_size = cfg.block_size or model.config.block_size
    if block_size > model.config.block_size:
        raise UserError(f"block_size {block_size} is larger than the model's {model.config.block_size}")
    data = TokenData(data_dir, cfg.split, block_size, model.config.vocab_size)
    stride = cfg.stride or block_size  # a stride past block_size is refused by split_windows
    r = on_ranks(evaluate_split, "windows", rt, stop, model, data, stride, cfg.batch_size, token_bytes=token_bytes(tok))
    scored = "assistant tokens, each conversation from its start" if data.starts is not None else "tokens"
    bpb = "n/a" if r.bpb is None else f"{r.bpb:.4f}"
    return (f"{data_dir} {cfg.split}: loss {r.loss:.4f} | perplexity {r.perplexity:.3f} | bits/byte {bpb} | "
            f"{r.tokens:,} {scored}, {r.bytes:,} bytes (block_size {block_size}, stride {stride})")


def hellaswag(cfg: EvalConfig, model, tok, rt: runtime.Runtime, examples, stop: runtime.StopFlag) -> str:
    rendered = render_examples(examples, tok, model.config.block_size)
    r = on_ranks(evaluate_hellaswag, "examples", rt, stop, model, rendered)
    return (f"hellaswag {cfg.hellaswag_file}: acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f} | "
            f"{r['examples']} examples")


def answers(cfg: EvalConfig, model, tok, rt: runtime.Runtime, conversations, stop: runtime.StopFlag) -> str:
    """--task=chat (exact answers to conversations) or a checked task's problems: a chat fine-tune's replies."""
    template = ChatTemplate.for_tokenizer(tok)
    if template is None:
        raise UserError(f"this model's tokenizer has no chat tokens (a base model): --task={cfg.task} needs a chat "
                        f"fine-tune (docs/chat.md)")
    if cfg.task == "chat":
        r = result_or_stop(chat_accuracy(model, template, conversations, stopped=lambda: stop.requested), stop)
        return f"chat {cfg.chat_file}: exact-answer accuracy {r['accuracy']:.4f} ({r['correct']}/{r['examples']})"
    tasklib.check_vocabulary([cfg.task], tok.encode, "this model's vocabulary")
    problems = tasklib.problems(cfg.task, cfg.task_split, cfg.task_examples)
    r = on_ranks(task_scores, "problems", rt, stop, model, template, cfg.task, problems, cfg.samples, cfg.temperature,
                 cfg.max_new_tokens, cfg.seed)
    if cfg.samples == 1 and cfg.temperature == 0:
        return (f"{cfg.task} {cfg.task_split}: exact match {r['mean']:.4f} ({round(r['mean'] * r['examples'])}/"
                f"{r['examples']}), greedy")
    return (f"{cfg.task} {cfg.task_split}: mean reward {r['mean']:.4f} (pass@1), "
            + ", ".join(f"pass@{k} {v:.4f}" for k, v in r["pass@k"].items() if k > 1)
            + f", {r['examples']} problems x {cfg.samples} replies at temperature {cfg.temperature}")


def main(argv: Sequence[str]) -> str:
    cfg = parse_args(EvalConfig, argv)
    # From the start: loading a large model takes a while, and a signal then must not be lost.
    stop = runtime.StopFlag(announce=runtime.dist_env()[0] == 0, message="stopping; no result").install()
    rt = runtime.setup(cfg.device, cfg.dtype, threads=cfg.threads)
    try:
        check_quantize(cfg.quantize, device=rt.device)  # before the model loads
        # A missing or malformed file is found before the model is loaded.
        examples = (load_hellaswag(cfg.hellaswag_file, cfg.max_examples) if cfg.task == "hellaswag" else
                    load_chat_file(cfg.chat_file, cfg.max_examples) if cfg.task == "chat" else None)
        stop.check("before the evaluation; no result")
        w = resolver.locate(cfg.init_from, cfg.out_dir)
        data_dir = run_data_dir(cfg, w) if cfg.task == "perplexity" else None  # a missing one, before the weights
        model, tok = resolver.build(w), w.tokenizer
        stop.check("before the evaluation; no result")
        if rt.is_master:
            print(f"evaluating {w.source} on {rt.device} in {rt.dtype}", file=sys.stderr)
        # --quantize: the weights cast and quantized as sample.py decodes them; else float weights under autocast
        model = inference_model(model, rt, quantize=cfg.quantize)[0] if cfg.quantize != "none" else model.to(rt.device)
        stop.message = "stopping after this batch; no result"
        if cfg.task == "perplexity":
            line = perplexity(cfg, model, tok, data_dir, rt, stop)
        elif cfg.task == "hellaswag":
            line = hellaswag(cfg, model, tok, rt, examples, stop)
        else:
            line = answers(cfg, model, tok, rt, examples, stop)
        if rt.is_master:
            print(line)
        return line
    finally:
        runtime.teardown(rt)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run_cli(main)
