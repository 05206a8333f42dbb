"""Tiny Shakespeare, one token per character: train.bin, val.bin (uint16) and meta.json beside this file.

    python data/shakespeare_char/prepare.py                          # input.txt here, else downloaded here
    python data/shakespeare_char/prepare.py --input=path/to/input.txt
    python data/shakespeare_char/prepare.py --out_dir=/tmp/shakespeare_char

The full text gives 65 characters, then <|endoftext|> (id 65, vocab_size 66: the end-of-text token every
vocabulary holds), and 1,003,854 train and 111,540 val tokens (a 90/10 split).
"""
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data.corpus import TextPrepareConfig, prepare_text_corpus  # noqa: E402
from core.errors import run_cli  # noqa: E402


def main(argv: Sequence[str]) -> dict:
    return prepare_text_corpus(parse_args(TextPrepareConfig, argv), "char", __file__)


if __name__ == "__main__":
    run_cli(main)
