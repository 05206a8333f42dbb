"""Judging a model: perplexity and bits per byte on a whole split, and HellaSwag.

Perplexity: every token of a prepared split is scored exactly once, from up to block_size tokens
of context, in a fixed order, so the figure is deterministic and comparable across runs (the
training loop's estimate_loss samples eval_iters random batches instead, for speed). Windows of
block_size inputs start every `stride` tokens; a window scores only the targets that no earlier
window scored. stride == block_size gives non-overlapping windows (fast; a token's context is
whatever precedes it in its window, 1 to block_size tokens); a smaller stride gives every token
scored after the first window at least block_size - stride + 1 tokens of context, for
block_size / stride times the compute (the sliding window of Hugging Face's perplexity guide).

HellaSwag (Zellers et al. 2019, https://github.com/rowanz/hellaswag): each example is a context
and 4 endings; the model picks the ending whose tokens, after context + " " + ending, have the
lowest loss. `acc` ranks by the summed loss of the ending's tokens, `acc_norm` by their mean, as
build-nanogpt's hellaswag.py and llm.c do (completion style, not the multiple-choice prompt of
the Eleuther harness).
"""
import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F

from core.data.loader import TokenData
from core.data.tokenizer import Tokenizer
from core.errors import UserError


def token_losses(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each target, x (B, T) -> (B, T) float32; 0 where y is -1."""
    logits, _ = model(x, y)  # with targets the model returns logits at every position, (B, T, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none").view_as(y)


# -----------------------------------------------------------------------------
# perplexity on a whole split


def split_windows(n_tokens: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows that score tokens 1..n_tokens-1 of a stream once each: (begin, end, new).

    A window feeds tokens[begin:end] and predicts tokens[begin+1:end+1]; only its last `new`
    targets are scored, the ones no earlier window scored.
    """
    if not 1 <= stride <= block_size:
        raise UserError(f"stride must be in [1, block_size={block_size}], got {stride}")
    windows, scored = [], 0  # targets tokens[1:scored+1] are done
    for begin in range(0, max(n_tokens - 1, 0), stride):
        end = min(begin + block_size, n_tokens - 1)
        windows.append((begin, end, end - scored))
        scored = end
        if end == n_tokens - 1:
            break
    return windows


@dataclass
class SplitResult:
    loss: float        # mean cross-entropy per token, in nats
    perplexity: float  # exp(loss)
    tokens: int        # tokens scored
    bpb: float | None = None  # bits per UTF-8 byte of the scored text (given token_bytes), None otherwise
    bytes: int = 0            # the UTF-8 bytes of the scored targets


@torch.no_grad()
def evaluate_split(model, data: TokenData, stride: int | None = None, batch_size: int = 8, device="cpu",
                   autocast=None, rank: int = 0, world_size: int = 1, progress=None,
                   token_bytes: list[int] | None = None, stopped=None) -> SplitResult | None:
    """Score every token of `data` (one split; each .bin file is its own stream) once.

    stride None means block_size: non-overlapping windows. With world_size > 1 each rank scores
    every world_size-th batch of windows and the sums are all-reduced. progress(done, total), if
    given, is called after each batch with how far into the list of all windows this rank is.

    token_bytes (core.data.tokenizer.token_bytes: the UTF-8 bytes of each id) adds bits per byte: the summed
    loss in bits over the bytes of the text scored, which tokenizers of any vocabulary share, so models
    with different tokenizers compare on the same text. As nanochat's evaluate_bpb, special tokens
    (no bytes) are left out of both sums.

    stopped(), if given, is called before each batch on every rank alike (it may be a collective);
    True ends the evaluation, returning None.
    """
    T = data.block_size
    stride = stride or T
    if data.starts is not None:  # chat: each conversation is its own stream (context never crosses into it)
        ends = [*data.starts[1:].tolist(), data.num_tokens]
        jobs = [(data.paths[0], (s + b, s + e, new)) for s, end in zip(data.starts.tolist(), ends)
                for b, e, new in split_windows(end - s, T, stride)]
    else:
        jobs = [(path, w) for path, n in zip(data.paths, data.sizes) for w in split_windows(n, T, stride)]
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # (summed loss, tokens, loss on bytes, bytes)
    nbytes = None if token_bytes is None else torch.tensor(token_bytes, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    # Every rank runs as many forwards (a sharded model's are collectives): a rank past the end
    # scores the first batch again and does not count it.
    for step in range(math.ceil(len(jobs) / (world_size * batch_size))):
        if stopped is not None and stopped():
            model.train(was_training)
            return None
        i = (step * world_size + rank) * batch_size
        x, y = _window_batch(data, jobs[i:i + batch_size] if i < len(jobs) else jobs[:batch_size], T)
        x, y = x.to(device), y.to(device)
        with autocast() if autocast else contextlib.nullcontext():
            losses = token_losses(model, x, y)  # (B, T)
        if i < len(jobs):
            b = _target_bytes(nbytes, y) if nbytes is not None else torch.zeros_like(losses, dtype=torch.float64)
            sums += torch.stack([losses.double().sum(), (y >= 0).sum().double(), (losses.double() * (b > 0)).sum(),
                                 b.sum()])
        if progress:
            progress(min(i + batch_size, len(jobs)), len(jobs))
    if world_size > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    loss = sums[0].item() / sums[1].item()
    bpb = sums[2].item() / math.log(2) / sums[3].item() if nbytes is not None and sums[3].item() else None
    return SplitResult(loss, math.exp(loss), int(sums[1].item()), bpb, int(sums[3].item()))


def _target_bytes(nbytes: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The UTF-8 bytes of each target, (B, T) float64; 0 where y is -1 (not scored) or past the tokenizer."""
    ok = (y >= 0) & (y < nbytes.numel())
    return torch.where(ok, nbytes[y.clamp(0, nbytes.numel() - 1)], torch.zeros((), dtype=nbytes.dtype, device=y.device))


def _window_batch(data: TokenData, jobs, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, T) and targets (B, T), -1 where a target is not scored or past a short window.
    Padding at the end of a row is harmless: causal attention never lets it reach earlier positions."""
    x = np.zeros((len(jobs), T), dtype=np.int64)
    y = np.full((len(jobs), T), -1, dtype=np.int64)
    for row, (path, (begin, end, new)) in enumerate(jobs):
        mm = np.memmap(path, dtype=data.dtype, mode="r")
        chunk = np.asarray(mm[begin:end + 1], dtype=np.int64)
        del mm
        n = end - begin
        x[row, :n] = chunk[:-1]
        y[row, n - new:n] = chunk[1:][n - new:]
        if data.mask_path is not None:  # chat: only the assistant's tokens are scored
            learned = np.fromfile(data.mask_path, dtype=np.uint8, count=n, offset=begin + 1).astype(bool)
            y[row, :n][~learned] = -1
    return torch.from_numpy(x), torch.from_numpy(y)


# -----------------------------------------------------------------------------
# HellaSwag


@dataclass
class HellaSwagExample:
    line: int           # 1-based line number in the file, for error messages
    context: str
    endings: list[str]  # 4
    label: int          # index of the right ending


def load_hellaswag(path: str | Path, limit: int = 0) -> list[HellaSwagExample]:
    """Examples of a HellaSwag jsonl file (keys ctx, endings, label); limit > 0 keeps the first `limit`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"HellaSwag file {path} not found; run python data/hellaswag/prepare.py "
                        f"(or pass --input=path/to/hellaswag_val.jsonl to it)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"HellaSwag file {path} is not UTF-8 text (byte {e.start}); "
                        f"re-run data/hellaswag/prepare.py") from None
    return parse_hellaswag(lines, str(path), limit)


def parse_hellaswag(lines: list[str], source: str, limit: int = 0) -> list[HellaSwagExample]:
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        examples.append(_parse_example(line, number, source))
        if limit and len(examples) == limit:
            break
    if not examples:
        raise UserError(f"HellaSwag file {source} holds no examples")
    return examples


def _parse_example(line: str, number: int, source: str) -> HellaSwagExample:
    where = f"{source} line {number}"
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON ({e.msg}); re-run data/hellaswag/prepare.py") from None
    if not isinstance(d, dict):
        raise UserError(f"{where} is a JSON {type(d).__name__}, expected an object with ctx, endings and label")
    endings, label = d.get("endings"), d.get("label")
    if not isinstance(d.get("ctx"), str) or not d["ctx"]:
        raise UserError(f"{where} has no non-empty string 'ctx'")
    if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
        raise UserError(f"{where}: 'endings' must be a list of 4 strings")
    if isinstance(label, str) and label.isdigit():
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < 4:
        raise UserError(f"{where}: 'label' must be 0, 1, 2 or 3, got {d.get('label')!r}")
    return HellaSwagExample(number, d["ctx"], endings, label)


def render_example(ex: HellaSwagExample, tok: Tokenizer, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4 candidate rows: tokens (4, L) of context + " " + ending, zero-padded, and mask (4, L),
    1 on the ending's tokens. A row longer than block_size keeps its last block_size tokens."""
    try:
        ctx = tok.encode(ex.context)
        ends = [tok.encode(" " + e) for e in ex.endings]
    except UserError as e:  # e.g. characters a char vocabulary lacks: the wrong tokenizer for this data
        raise UserError(f"HellaSwag line {ex.line} cannot be encoded with the model's tokenizer: {e}") from None
    rows, masks = [], []
    for end in ends:
        if len(end) >= block_size:
            raise UserError(f"HellaSwag line {ex.line}: an ending of {len(end)} tokens leaves no context in the "
                            f"model's block_size {block_size}")
        row = (ctx + end)[-block_size:]
        rows.append(row)
        masks.append([0] * (len(row) - len(end)) + [1] * len(end))
    L = max(len(r) for r in rows)
    tokens = torch.zeros(4, L, dtype=torch.long)
    mask = torch.zeros(4, L, dtype=torch.long)
    for i, (row, m) in enumerate(zip(rows, masks)):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, :len(m)] = torch.tensor(m)
    return tokens, mask


@torch.no_grad()
def ending_losses(model, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean loss of each row's ending tokens: tokens, mask (4, L) -> (4,), (4,)."""
    x = tokens[:, :-1]
    y = tokens[:, 1:].masked_fill(mask[:, 1:] == 0, -1)  # target t+1 is scored when token t+1 is an ending token
    losses = token_losses(model, x, y)  # (4, L-1)
    total = losses.sum(dim=1)
    return total, total / mask[:, 1:].sum(dim=1)


def render_examples(examples: list[HellaSwagExample], tok: Tokenizer, block_size: int) -> list[tuple]:
    """(tokens, mask, label) per example: encode once, before any scoring, so a tokenizer that
    cannot encode the file fails at the start of a run, not at its first eval."""
    return [(*render_example(ex, tok, block_size), ex.label) for ex in examples]


@torch.no_grad()
def evaluate_hellaswag(model, rendered: list[tuple], device="cpu", autocast=None, rank: int = 0,
                       world_size: int = 1, progress=None, stopped=None) -> dict[str, float] | None:
    """acc, acc_norm and the number of examples, from render_examples' output. With world_size > 1
    each rank scores every world_size-th example and the counts are all-reduced; every rank runs
    the same number of forwards (a rank short of one scores a spare it does not count), which
    sharded models need. progress(done, total) as in evaluate_split; stopped(), if given, is called
    before each example on every rank, and True ends the evaluation with None. The model is left in
    the mode it came in."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # (right by sum, right by mean, examples)
    for step in range(math.ceil(len(rendered) / world_size)):
        if stopped is not None and stopped():
            model.train(was_training)
            return None
        index = step * world_size + rank
        tokens, mask, label = rendered[min(index, len(rendered) - 1)]
        with autocast() if autocast else contextlib.nullcontext():
            total, mean = ending_losses(model, tokens.to(device), mask.to(device))
        if index < len(rendered):
            counts += torch.tensor([int(total.argmin()) == label, int(mean.argmin()) == label, 1.0],
                                   dtype=torch.float64, device=device)
        if progress:
            progress(min(index + 1, len(rendered)), len(rendered))
    if world_size > 1:
        dist.all_reduce(counts)
    model.train(was_training)
    right, right_norm, n = counts.tolist()
    return {"acc": right / n, "acc_norm": right_norm / n, "examples": int(n)}


def hellaswag_scores(model, rendered: list[tuple] | None, rt, stopped=None) -> dict[str, float] | None:
    """train.py's eval record entries, {} when no HellaSwag file was given, None if stopped() said so.
    Pass the plain module: examples vary in length, which a compiled one would recompile for."""
    if not rendered:
        return {}
    r = evaluate_hellaswag(model, rendered, rt.device, rt.autocast, rt.rank, rt.world_size, stopped=stopped)
    if r is None:
        return None
    return {"hellaswag_acc": r["acc"], "hellaswag_acc_norm": r["acc_norm"]}


# -----------------------------------------------------------------------------
# chat: exact answers


def load_chat_file(path: str | Path, limit: int = 0) -> list[list[dict]]:
    """The conversations of a JSONL file ({"messages": [...]} per line), each ending with the expected answer."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"chat file {path} not found (data/chat/tasks.py writes tasks_heldout.jsonl)")
    convs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{number}: expected a JSON object with a \"messages\" list") from None
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
            raise UserError(f"{path}:{number}: the last message must be the expected assistant answer")
        convs.append(messages)
        if limit and len(convs) == limit:
            break
    if not convs:
        raise UserError(f"no conversations in {path}")
    return convs


@torch.no_grad()
def chat_accuracy(model, template, conversations: list[list[dict]], max_new_tokens: int = 64,
                  stopped=None) -> dict | None:
    """The fraction of conversations whose last assistant turn the model reproduces exactly, greedily,
    from the messages before it; None if stopped(), called before each conversation, says so."""
    from core.data.chat import reply

    was_training = model.training
    model.eval()
    correct = 0
    for conv in conversations:
        if stopped is not None and stopped():
            model.train(was_training)
            return None
        answer = conv[-1]["content"]
        # A reply longer than the answer is wrong whatever follows: decoding stops one token past the answer.
        n = min(max_new_tokens, len(template.tok.encode(answer)) + 1)
        correct += reply(model, template, conv[:-1], n, temperature=0.0) == answer
    model.train(was_training)
    return {"accuracy": correct / len(conversations), "correct": correct, "examples": len(conversations)}


# -----------------------------------------------------------------------------
# tasks with checkers (core/data/tasks.py): exact-match and pass@k on held-out problems


def sample_seed(seed: int, *path: int) -> int:
    """The seed of one batch of replies, from the run's seed and where the batch is (an iteration, a problem's
    index): the same replies on any number of processes and after any resume, with nothing to save. A seed the
    server takes too (its `seed` field), so one reply can be asked of it and compared."""
    mixed = seed
    for part in path:
        mixed = (mixed * 1_000_003 + part) % (1 << 62)
    return mixed


def sampler(seed: int, *path: int, device="cpu") -> torch.Generator:
    """A generator seeded with sample_seed(seed, *path)."""
    return torch.Generator(device=device).manual_seed(sample_seed(seed, *path))


@torch.no_grad()
def task_scores(model, template, name: str, problems: list, samples: int = 1, temperature: float = 0.0,
                max_new_tokens: int = 32, seed: int = 0, device="cpu", autocast=None, rank: int = 0,
                world_size: int = 1, progress=None, stopped=None) -> dict | None:
    """Each problem's replies scored by task `name`'s checker: one greedy reply (temperature 0), or `samples`
    replies at a temperature, drawn in one batched generate per problem (chat.sample_replies, as rl.py samples).

    Returns {"mean": the mean reward over every reply (exact-match accuracy, or pass@1, for a 0/1 checker),
    "pass@k": the fraction of problems with an accepted reply (reward 1) among their k = samples replies,
    "examples", "samples"}; None if stopped(), called before each problem, says so. With world_size > 1 each
    rank replies to every world_size-th problem and the sums are all-reduced. progress(done, total) as in
    evaluate_split."""
    from core.data.chat import reply_text, sample_replies
    from core.data.tasks import TASKS, messages

    check = TASKS[name].check
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # (reward, problems with an accepted reply, problems)
    for step in range(math.ceil(len(problems) / world_size)):  # as many stopped() calls on every rank
        if stopped is not None and stopped():
            model.train(was_training)
            return None
        i = step * world_size + rank
        if progress:
            progress(min(i + 1, len(problems)), len(problems))
        if i >= len(problems):
            continue
        prompt = template.render_prompt(messages(problems[i]))
        budget = min(max_new_tokens, model.config.block_size - len(prompt))
        with autocast() if autocast else contextlib.nullcontext():
            replies = sample_replies(model, template, prompt, samples, budget, temperature=temperature,
                                     generator=sampler(seed, i, device=device))
        rewards = [check(problems[i], reply_text(template, r)) for r in replies]
        sums += torch.tensor([sum(rewards) / samples, float(max(rewards) == 1.0), 1.0], dtype=torch.float64)
    if world_size > 1:
        sums = sums.to(device)
        dist.all_reduce(sums)
    model.train(was_training)
    reward, solved, n = sums.tolist()
    return {"mean": reward / n, "pass@k": solved / n, "examples": int(n), "samples": samples}
