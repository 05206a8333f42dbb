"""Any text -> train.bin, val.bin and meta.json (+ tokenizer.json for a BPE or a folder's tokenizer).

    python data/text/prepare.py --input=book.txt --tokenizer=char                   # one token per character
    python data/text/prepare.py --input='src/**/*.py' --tokenizer=bpe:8192 --out_dir=data/code   # train a BPE
    python data/text/prepare.py --input=a.txt --input=b.txt --tokenizer=gpt2         # GPT-2's BPE (tiktoken)
    python data/text/prepare.py --input=corpus.txt --separator='<|endoftext|>' --tokenizer=path/to/hf_folder

--input takes files or globs (quoted), several times or comma-separated; a document is one file, or with
--separator=LINE the lines between two lines exactly LINE; the val split is whole documents (docs/tokenizers.md).
"""
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repo's core/ importable

from core.config import parse_args  # noqa: E402
from core.data.corpus import check_tokenizer_spec, prepare_corpus  # noqa: E402
from core.data.writer import script_out_dir  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402


@dataclasses.dataclass
class CorpusConfig:
    input: str | None = None      # files or globs, comma-separated; --input may be given several times
    tokenizer: str = "gpt2"       # char | gpt2 | bpe:VOCAB | a transformers folder or tokenizer.json
    out_dir: str | None = None    # default: this script's folder
    separator: str | None = None  # a line that ends a document; default: each file is one document
    val_fraction: float = 0.1     # of documents, held out as the val split
    seed: int = 1337              # of the train/val split

    def validate(self) -> None:
        if not self.input:
            raise UserError("no input: pass --input=FILE_OR_GLOB (several times or comma-separated)")
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"val_fraction must be between 0 and 1, got {self.val_fraction}")
        check_tokenizer_spec(self.tokenizer)


def main(argv: Sequence[str]) -> dict:
    inputs = [a.partition("=")[2] for a in argv if a.startswith("--input=")]
    rest = [a for a in argv if not a.startswith("--input=")]
    cfg = parse_args(CorpusConfig, rest + ([f"--input={','.join(inputs)}"] if inputs else []))
    return prepare_corpus([p for p in cfg.input.split(",") if p], cfg.tokenizer, script_out_dir(cfg.out_dir, __file__),
                          cfg.val_fraction, cfg.seed, cfg.separator)


if __name__ == "__main__":
    run_cli(main)
