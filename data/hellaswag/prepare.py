"""HellaSwag's validation set (10,042 examples) as hellaswag_val.jsonl beside this file, checked line by line.

    python data/hellaswag/prepare.py                                  # download from the reference location
    python data/hellaswag/prepare.py --input=path/to/hellaswag_val.jsonl   # offline: a local copy
    python eval.py --init_from=gpt2 --task=hellaswag                  # then score a model on it

The file comes from the dataset's authors (Zellers et al. 2019, https://github.com/rowanz/hellaswag),
the copy build-nanogpt and llm.c read. Each line is one example: ctx, 4 endings, the label of the right one.
"""
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data.corpus import download  # noqa: E402
from core.data.writer import script_out_dir  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402
from core.evaluation.hellaswag import parse_hellaswag  # noqa: E402
from core.fileio import atomic_path  # noqa: E402

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
FILE_NAME = "hellaswag_val.jsonl"


@dataclass
class HellaSwagPrepareConfig:
    input: str | None = None    # a local copy of hellaswag_val.jsonl; None: download it
    out_dir: str | None = None  # None: beside this script
    timeout_s: float = 30.0


def fetch(cfg: HellaSwagPrepareConfig) -> bytes:
    if cfg.input is not None:
        try:
            return Path(cfg.input).read_bytes()
        except OSError as e:
            raise UserError(f"--input file '{cfg.input}' cannot be read: {e.strerror}") from None
    print(f"downloading {URL}")
    return download(URL, cfg.timeout_s, FILE_NAME)


def main(argv: Sequence[str]) -> Path:
    cfg = parse_args(HellaSwagPrepareConfig, argv)
    out = script_out_dir(cfg.out_dir, __file__) / FILE_NAME
    data = fetch(cfg)
    source = cfg.input or URL
    try:
        examples = parse_hellaswag(data.decode("utf-8").splitlines(), source)  # every line checked before writing
    except UnicodeDecodeError as e:
        raise UserError(f"{source} is not UTF-8 text (byte {e.start}); pass the original {FILE_NAME}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_bytes(data)
    print(f"wrote {len(examples):,} examples to {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
