"""Conversations for supervised fine-tuning: JSONL in OpenAI's messages format -> token, mask and start files.

    python data/chat/prepare.py --input=chat.jsonl                                  # GPT-2 BPE (the default)
    python data/chat/prepare.py --input=a.jsonl --input=b.jsonl --out_dir=data/mychat
    python data/chat/prepare.py --input=chat.jsonl --tokenizer_from=out-shakespeare-char-cpu --block_size=64
    python data/chat/tasks.py --out_dir=data/chat && python data/chat/prepare.py \\
        --input=data/chat/tasks_train.jsonl --tokenizer_from=out-shakespeare-char-cpu --block_size=64

Each line is one conversation, {"messages": [{"role": ..., "content": "..."}, ...]}; one longer than block_size + 1
tokens is cut or dropped (--overlong), and a bad line stops the run with one line, nothing written. The template,
the files and the checks: docs/chat.md.
"""
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data.chat import ChatTemplate, with_chat_tokens  # noqa: E402
from core.data.loader import read_meta  # noqa: E402
from core.data.tokenizer import GPT2Tokenizer, tokenizer_from_meta, tokenizer_meta  # noqa: E402
from core.data.writer import script_out_dir, token_dtype, write_dataset, write_tokens  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402


@dataclasses.dataclass
class ChatPrepareConfig:
    input: str | None = None           # JSONL file(s): --input=a.jsonl --input=b.jsonl, or --input=a.jsonl,b.jsonl
    tokenizer: str = "gpt2"            # the tokenizer when tokenizer_from is not given: gpt2
    tokenizer_from: str | None = None  # a run's out_dir (its checkpoint's tokenizer) or a prepared dataset folder
    out_dir: str | None = None         # default: this script's folder
    block_size: int = 1024             # the fine-tune's block_size: longer conversations are cut or dropped
    overlong: str = "cut"              # cut (keep the first block_size + 1 tokens if they hold an assistant token) | drop
    val_fraction: float = 0.1          # of conversations, held out as the val split (at least one)
    seed: int = 1337                   # of the train/val split

    def validate(self) -> None:
        if not self.input:
            raise UserError("no input: pass --input=conversations.jsonl (one {\"messages\": [...]} per line)")
        if self.tokenizer != "gpt2":
            raise UserError(f"tokenizer must be gpt2, got '{self.tokenizer}'; for a character model pass "
                            f"--tokenizer_from=its out_dir or its dataset folder")
        if self.block_size < 2:
            raise UserError(f"block_size must be at least 2, got {self.block_size}")
        if self.overlong not in ("cut", "drop"):
            raise UserError(f"overlong must be cut or drop, got '{self.overlong}'")
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"val_fraction must be between 0 and 1, got {self.val_fraction}")


def base_tokenizer_meta(cfg: ChatPrepareConfig) -> dict:
    """The tokenizer metadata of the model to be fine-tuned (before the chat tokens are added)."""
    if cfg.tokenizer_from is None:
        return GPT2Tokenizer().meta()
    path = Path(cfg.tokenizer_from)
    if (path / "meta.json").is_file():  # a prepared dataset
        return tokenizer_meta(read_meta(path))
    from core.weights import checkpoint  # a run's out_dir; torch is needed only here

    found = checkpoint.find_checkpoint(path)
    if found is None:
        raise UserError(f"--tokenizer_from={path} holds neither meta.json (a prepared dataset) nor a checkpoint "
                        f"(a run's out_dir with {checkpoint.CKPT_NAME})")
    meta = checkpoint.load_checkpoint(found)["meta"]
    if not isinstance(meta.get("tokenizer"), dict):
        raise UserError(f"checkpoint {found} has no tokenizer metadata")
    return meta["tokenizer"]


def read_conversations(paths: list[str], template: ChatTemplate) -> list[tuple[list[int], list[int]]]:
    """Every conversation of the JSONL files, rendered; a UserError naming every bad line if any is bad."""
    rendered, problems = [], []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise UserError(f"--input file '{name}' not found")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise UserError(f"{name} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rendered.append(template.render(parse_line(line)))
            except UserError as e:
                problems.append(f"{name}:{number}: {e}")
    if problems:
        more = f"; and {len(problems) - 1} more bad line(s)" if len(problems) > 1 else ""
        raise UserError(f"{problems[0]}{more}; nothing written")
    if not rendered:
        raise UserError(f"no conversations in {', '.join(paths)}")
    return rendered


def parse_line(line: str) -> list:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict) or "messages" not in record:
        raise UserError("expected an object with a \"messages\" list")
    return record["messages"]


def fit_block(convs: list[tuple[list[int], list[int]]], block_size: int,
              overlong: str) -> tuple[list[tuple[list[int], list[int]]], int, int]:
    """Conversations of at most block_size + 1 tokens (one training row): (kept, how many cut, dropped)."""
    limit, kept, cut, dropped = block_size + 1, [], 0, 0
    for ids, mask in convs:
        if len(ids) <= limit or (overlong == "cut" and any(mask[:limit])):
            kept.append((ids[:limit], mask[:limit]))
            cut += len(ids) > limit
        else:
            dropped += 1
    return kept, cut, dropped


def split_conversations(convs: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded random val_fraction of the conversations (at least one) as val, the rest as train."""
    if len(convs) < 2:
        raise UserError(f"{len(convs)} conversation(s) left; a train and a val split need at least 2")
    order = np.random.default_rng(seed).permutation(len(convs))
    n_val = min(len(convs) - 1, max(1, round(len(convs) * val_fraction)))
    val = set(order[:n_val].tolist())
    return [c for i, c in enumerate(convs) if i not in val], [c for i, c in enumerate(convs) if i in val]


def main(argv: Sequence[str]) -> dict:
    # --input may be given several times: gather them into one comma-separated value.
    inputs = [a.partition("=")[2] for a in argv if a.startswith("--input=")]
    rest = [a for a in argv if not a.startswith("--input=")]
    cfg = parse_args(ChatPrepareConfig, rest + ([f"--input={','.join(inputs)}"] if inputs else []))
    out_dir = script_out_dir(cfg.out_dir, __file__)
    start = time.perf_counter()
    tok_meta = with_chat_tokens(base_tokenizer_meta(cfg))
    template = ChatTemplate(tokenizer_from_meta(tok_meta, source="the chat tokenizer"))
    paths = [p for p in cfg.input.split(",") if p]
    convs, cut, dropped = fit_block(read_conversations(paths, template), cfg.block_size, cfg.overlong)
    if cut or dropped:
        print(f"{cut + dropped} conversation(s) longer than block_size + 1 = {cfg.block_size + 1} tokens: "
              f"{cut} cut to fit, {dropped} dropped")
    splits = dict(zip(("train", "val"), split_conversations(convs, cfg.val_fraction, cfg.seed)))
    extra = {"chat": template.meta(), "block_size": cfg.block_size, "source": paths, "cut": cut, "dropped": dropped}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, part in splits.items():  # the mask and the starts before meta.json, whose counts vouch for them
        mask = [m for _, ms in part for m in ms]
        write_tokens(out_dir / f"{split}_mask.bin", mask, np.uint8)
        write_tokens(out_dir / f"{split}_starts.bin", np.cumsum([0] + [len(c) for c, _ in part[:-1]]), np.int64)
        extra |= {f"{split}_conversations": len(part), f"{split}_learned_tokens": int(sum(mask))}
    meta = write_dataset(out_dir, tok_meta, {split: [t for c, _ in part for t in c] for split, part in splits.items()},
                         token_dtype(template.tok), **extra)
    print(f"{meta['train_conversations']:,} train / {meta['val_conversations']:,} val conversations: "
          f"{meta['train_tokens']:,} / {meta['val_tokens']:,} tokens ({meta['train_learned_tokens']:,} / "
          f"{meta['val_learned_tokens']:,} learned), vocab_size {meta['vocab_size']}, to {out_dir} "
          f"in {time.perf_counter() - start:.1f}s")
    return meta


if __name__ == "__main__":
    run_cli(main)
