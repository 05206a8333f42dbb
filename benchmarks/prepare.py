"""Data preparation: core.data.corpus.prepare_text_corpus with GPT-2's BPE (data/shakespeare/prepare.py's path) into
a temporary folder, from --corpus, else common.DEFAULT_CORPUS where it exists, else a generated text of its size.
"""
import contextlib
import dataclasses
import io
import tempfile
from pathlib import Path

from benchmarks import common
from benchmarks.common import markdown_table, median_time, num
from core import runtime
from core.data.corpus import TextPrepareConfig, prepare_text_corpus
from core.data.tokenizer import GPT2Tokenizer
from core.errors import UserError


@dataclasses.dataclass
class Settings:
    corpus: str | None = None  # a text file; None: DEFAULT_CORPUS if it exists, else a generated text


def preflight(cfg) -> None:
    GPT2Tokenizer()  # fail now, not after minutes of measuring, if the BPE file cannot be loaded


def measure(cfg, rt: runtime.Runtime) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.corpus is not None:
            if not Path(cfg.corpus).is_file():
                raise UserError(f"--corpus file '{cfg.corpus}' not found")
            path, source = Path(cfg.corpus), cfg.corpus
        elif Path(common.DEFAULT_CORPUS).is_file():
            path, source = Path(common.DEFAULT_CORPUS), common.DEFAULT_CORPUS
        else:
            path, source = Path(tmp) / "generated.txt", f"generated text ({common.DEFAULT_CORPUS} not found)"
            path.write_text(common.generated_text(common.GENERATED_CHARS), encoding="utf-8")
        prep = TextPrepareConfig(input=str(path), out_dir=str(Path(tmp) / "out"))

        def run() -> dict:
            with contextlib.redirect_stdout(io.StringIO()):  # its one-line summary would break the tables
                return prepare_text_corpus(prep, "gpt2", str(common.ROOT / "bench.py"))

        meta = run()  # the first run is a warm-up too: it reads the file into the page cache
        dt = median_time(run, max(0, cfg.warmup - 1), cfg.repeats)
        chars = len(path.read_text(encoding="utf-8"))
    tokens = meta["train_tokens"] + meta["val_tokens"]
    return {"corpus": source, "path": "core.data.corpus.prepare_text_corpus + GPT2Tokenizer (data/shakespeare/prepare.py)",
            "chars": chars, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def table(r: dict) -> str:
    return (f"### Data preparation (GPT-2 BPE)\n{r['path']}, corpus: {r['corpus']}\n\n"
            + markdown_table(["chars", "tokens", "seconds", "tokens/s"],
                             [[num(r["chars"]), num(r["tokens"]), num(r["seconds"], 3), num(r["tokens_per_s"])]]))
