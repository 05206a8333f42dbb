"""HellaSwag (Zellers et al. 2019, https://github.com/rowanz/hellaswag): the model picks the one of 4 endings whose
tokens have the lowest loss after the context, `acc` by the sum, `acc_norm` by the mean (docs/evaluation.md).
"""
import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

from core.data.tokenizer import Tokenizer
from core.errors import UserError
from core.evaluation.perplexity import evaluating, token_losses


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
        examples.append(HellaSwagExample(number, d["ctx"], endings, label))
        if limit and len(examples) == limit:
            break
    if not examples:
        raise UserError(f"HellaSwag file {source} holds no examples")
    return examples


def render_examples(examples: list[HellaSwagExample], tok: Tokenizer, block_size: int) -> list[tuple]:
    """(tokens, mask, label) per example: the 4 rows of context + " " + ending, zero-padded, (4, L), and mask (4, L),
    1 on the ending's tokens; a row longer than block_size keeps its last block_size tokens. All are encoded before
    any scoring, so a tokenizer that cannot encode the file fails at the start of a run, not at its first eval."""
    pad = lambda rows: pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True)  # noqa: E731
    rendered = []
    for ex in examples:
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
            rows.append((ctx + end)[-block_size:])
            masks.append([0] * (len(rows[-1]) - len(end)) + [1] * len(end))
        rendered.append((pad(rows), pad(masks), ex.label))
    return rendered


@torch.no_grad()
def ending_losses(model, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean loss of each row's ending tokens: tokens, mask (4, L) -> (4,), (4,)."""
    x = tokens[:, :-1]
    y = tokens[:, 1:].masked_fill(mask[:, 1:] == 0, -1)  # target t+1 is scored when token t+1 is an ending token
    losses = token_losses(model, x, y)  # (4, L-1)
    total = losses.sum(dim=1)
    return total, total / mask[:, 1:].sum(dim=1)


@evaluating
def evaluate_hellaswag(model, rendered: list[tuple], device="cpu", autocast=None, rank: int = 0,
                       world_size: int = 1, progress=None, stopped=None) -> dict[str, float] | None:
    """acc, acc_norm and the number of examples, from render_examples' output. Ranks, progress and stopped as in
    evaluate_split; every rank runs as many forwards (a spare it does not count), which sharded models need."""
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # (right by sum, right by mean, examples)
    for step in range(math.ceil(len(rendered) / world_size)):
        if stopped is not None and stopped():
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
    right, right_norm, n = counts.tolist()
    return {"acc": right / n, "acc_norm": right_norm / n, "examples": int(n)}


def hellaswag_scores(model, rendered: list[tuple] | None, rt, stopped=None) -> dict[str, float] | None:
    """train.py's eval record entries, {} when no HellaSwag file was given, None if stopped() said so.
    Pass the plain module: examples vary in length, which a compiled one would recompile for."""
    if not rendered:
        return {}
    r = evaluate_hellaswag(model, rendered, rt.device, rt.autocast, rt.rank, rt.world_size, stopped=stopped)
    return None if r is None else {"hellaswag_acc": r["acc"], "hellaswag_acc_norm": r["acc_norm"]}
