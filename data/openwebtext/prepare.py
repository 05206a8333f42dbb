"""OpenWebText in GPT-2's BPE: train_*.bin and val_*.bin shards (uint16) and meta.json beside this file.

    python data/openwebtext/prepare.py --num_proc=8                        # from the Hugging Face hub
    python data/openwebtext/prepare.py --data_files=owt/*.parquet          # local files with a `text` column
    python data/openwebtext/prepare.py --dataset=Skylion007/openwebtext --val_fraction=0.0005 --shard_tokens=100000000

Every document ends with <|endoftext|> (50256). About 9.0B train and 4.4M val tokens: ~18 GB of .bin.
The Hugging Face cache (--cache_dir) also holds the download (nanoGPT reports 54 GB for it) and a
tokenized copy about the size of the .bin files.
"""
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.prepare import WebPrepareConfig, prepare_web_corpus  # noqa: E402
from core.errors import run_cli  # noqa: E402


@dataclasses.dataclass
class OpenWebTextConfig(WebPrepareConfig):
    dataset: str = "Skylion007/openwebtext"  # hub name, used when --data_files is not given


def main(argv: Sequence[str]) -> dict:
    cfg = parse_args(OpenWebTextConfig, argv)
    return prepare_web_corpus(cfg, cfg.dataset, None, __file__)


if __name__ == "__main__":
    run_cli(main)
