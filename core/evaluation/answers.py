"""A chat model's answers scored: exact match on held-out conversations, a checked task's exact match and pass@k.
"""
import contextlib
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from core.data.tasks import TASKS, messages
from core.decoding.replies import reply, reply_text, sample_replies, sampler
from core.errors import UserError
from core.evaluation.perplexity import evaluating


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


@evaluating
def chat_accuracy(model, template, conversations: list[list[dict]], max_new_tokens: int = 64,
                  stopped=None) -> dict | None:
    """The fraction of conversations whose last assistant turn the model reproduces exactly, greedily,
    from the messages before it; None if stopped(), called before each conversation, says so."""
    correct = 0
    for conv in conversations:
        if stopped is not None and stopped():
            return None
        answer = conv[-1]["content"]
        # A reply longer than the answer is wrong whatever follows: decoding stops one token past the answer.
        n = min(max_new_tokens, len(template.tok.encode(answer)) + 1)
        correct += reply(model, template, conv[:-1], n, temperature=0.0) == answer
    return {"accuracy": correct / len(conversations), "correct": correct, "examples": len(conversations)}


@evaluating
def task_scores(model, template, name: str, problems: list, samples: int = 1, temperature: float = 0.0,
                max_new_tokens: int = 32, seed: int = 0, device="cpu", autocast=None, rank: int = 0,
                world_size: int = 1, progress=None, stopped=None) -> dict | None:
    """Each problem's replies scored by task `name`'s checker: one greedy reply, or `samples` at a temperature in one
    batched decode per problem (as rl.py samples) -> {"mean": reward over every reply (accuracy or pass@1),
    "pass@k": {k: pass_at_k for k = 1, 2, 4, ... and samples}, "examples", "samples"}. Ranks, progress and stopped
    as in evaluate_split."""
    check = TASKS[name].check
    ks = sorted({2 ** i for i in range(samples.bit_length())} | {samples})  # 1, 2, 4, ... up to samples, and samples
    sums = torch.zeros(2 + len(ks), dtype=torch.float64)  # (reward, problems, pass@k for each k)
    for step in range(math.ceil(len(problems) / world_size)):  # as many stopped() calls on every rank
        if stopped is not None and stopped():
            return None
        i = step * world_size + rank
        if progress:
            progress(min(i + 1, len(problems)), len(problems))
        if i >= len(problems):
            continue
        prompt = template.render_prompt(messages(problems[i]))
        with autocast() if autocast else contextlib.nullcontext():
            replies = sample_replies(model, template, [prompt], samples, max_new_tokens, temperature=temperature,
                                     generators=[sampler(seed, i, device=device)])[0]
        rewards = [check(problems[i], reply_text(template, r)) for r in replies]
        accepted = sum(r == 1.0 for r in rewards)
        sums += torch.tensor([sum(rewards) / samples, 1.0] + [pass_at_k(samples, accepted, k) for k in ks],
                             dtype=torch.float64)
    if world_size > 1:
        sums = sums.to(device)
        dist.all_reduce(sums)
    reward, n, *passed = sums.tolist()
    return {"mean": reward / n, "pass@k": {k: p / n for k, p in zip(ks, passed)}, "examples": int(n),
            "samples": samples}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that k of n replies (c accepted), drawn without replacement, hold an accepted one: 1 - C(n-c, k) /
    C(n, k), the unbiased estimator of pass@k (Chen et al. 2021)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)
