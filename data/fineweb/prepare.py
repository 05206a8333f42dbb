"""FineWeb's 10B-token sample (or FineWeb-Edu's) in GPT-2's BPE (or --tokenizer=): train_*.bin and val_*.bin
shards and meta.json beside this file. It is the corpus llm.c and the GPT-2 speedruns train and validate on.

    python data/fineweb/prepare.py --num_proc=8                   # HuggingFaceFW/fineweb, sample-10BT
    python data/fineweb/prepare.py --edu=True                     # HuggingFaceFW/fineweb-edu, sample-10BT
    python data/fineweb/prepare.py --data_files=fw/*.parquet      # local files with a `text` column
    python data/fineweb/prepare.py --tokenizer=bpe:32768          # a BPE trained on the train split

--tokenizer is data/openwebtext/prepare.py's. About 10B tokens: ~20 GB of .bin in 200 MB shards, plus the
download and its tokenized copy in the Hugging Face cache (--cache_dir).
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
class FineWebConfig(WebPrepareConfig):
    edu: bool = False             # FineWeb-Edu (educational pages) instead of FineWeb
    sample: str = "sample-10BT"   # hub config: sample-10BT, sample-100BT, sample-350BT, ...


def hub_source(cfg: FineWebConfig) -> tuple[str, str]:
    return ("HuggingFaceFW/fineweb-edu" if cfg.edu else "HuggingFaceFW/fineweb"), cfg.sample


def main(argv: Sequence[str]) -> dict:
    cfg = parse_args(FineWebConfig, argv)
    return prepare_web_corpus(cfg, *hub_source(cfg), __file__)


if __name__ == "__main__":
    run_cli(main)
