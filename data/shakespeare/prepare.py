"""Tiny Shakespeare in GPT-2's BPE (tiktoken): train.bin, val.bin (uint16) and meta.json beside this file.

    python data/shakespeare/prepare.py                          # input.txt here, else downloaded here
    python data/shakespeare/prepare.py --input=path/to/input.txt
    TIKTOKEN_CACHE_DIR=/path/to/cache python data/shakespeare/prepare.py   # offline: a cached r50k_base file

The full text gives 301,966 train and 36,059 val tokens (the characters are split 90/10, then encoded).
"""
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data.corpus import TextPrepareConfig, prepare_text_corpus  # noqa: E402
from core.errors import run_cli  # noqa: E402


def main(argv: Sequence[str]) -> dict:
    return prepare_text_corpus(parse_args(TextPrepareConfig, argv), "gpt2", __file__)


if __name__ == "__main__":
    run_cli(main)
