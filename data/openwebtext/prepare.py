"""OpenWebText in GPT-2's BPE (or --tokenizer=): train_*.bin and val_*.bin shards and meta.json beside this file.

    python data/openwebtext/prepare.py --num_proc=8                        # from the Hugging Face hub
    python data/openwebtext/prepare.py --data_files=owt/*.parquet          # local files with a `text` column
    python data/openwebtext/prepare.py --dataset=Skylion007/openwebtext --val_fraction=0.0005 --shard_tokens=100000000
    python data/openwebtext/prepare.py --tokenizer=bpe:32768               # a BPE trained on the train split
    python data/openwebtext/prepare.py --tokenizer=path/to/hf_folder       # that model's tokenizer, to fine-tune it

--tokenizer is data/text/prepare.py's, without char; the val split is whole documents. In GPT-2's BPE: about 9.0B
train and 4.4M val tokens, ~18 GB of .bin, plus the download and a tokenized copy in the hub cache (docs/training.md).
"""
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data.web import WebPrepareConfig, prepare_web_corpus  # noqa: E402
from core.errors import run_cli  # noqa: E402


@dataclasses.dataclass
class OpenWebTextConfig(WebPrepareConfig):
    dataset: str = "Skylion007/openwebtext"  # hub name, used when --data_files is not given


def main(argv: Sequence[str]) -> dict:
    cfg = parse_args(OpenWebTextConfig, argv)
    return prepare_web_corpus(cfg, cfg.dataset, None, __file__)


if __name__ == "__main__":
    run_cli(main)
