"""The tables of docs/tokenizers.md: trained BPEs against GPT-2's BPE on two corpora that are not English prose.

    python scripts/tokenizer_proof.py --work=/tmp/tokproof                 # tokenizer tables only
    python scripts/tokenizer_proof.py --work=/tmp/tokproof2 --vocabs=8192 --val_fraction=0.03 --train_iters=100

The corpora and what is measured: docs/tokenizers.md, "Measured: code and Chinese". Each data/text/prepare.py runs
as its own process, so that wait4 gives its peak RSS; bytes per token are counted on the val split.
"""
import argparse
import gettext
import glob
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.data.tokenizer import token_bytes, tokenizer_from_meta  # noqa: E402

import numpy as np  # noqa: E402


def chinese_corpus(work: Path) -> str:
    out = work / "zh_CN"
    out.mkdir(parents=True, exist_ok=True)
    for mo in sorted(glob.glob("/usr/share/locale/zh_CN/LC_MESSAGES/*.mo")):
        with open(mo, "rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog  # {msgid: msgstr}; "" is the header
        text = "\n".join(v for k, v in catalog.items() if k and isinstance(v, str) and v.strip())
        (out / (Path(mo).stem + ".txt")).write_text(text + "\n", encoding="utf-8")
    return str(out / "*.txt")


def prepare(inputs: str, tok: str, out: Path, val_fraction: float = 0.1) -> dict:
    cmd = [sys.executable, "data/text/prepare.py", f"--input={inputs}", f"--tokenizer={tok}", f"--out_dir={out}",
           f"--val_fraction={val_fraction}"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read()
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    meta = json.loads((out / "meta.json").read_text())
    trained = re.search(r"trained the BPE in ([\d.]+)s", err)
    ids = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    counts = np.array(token_bytes(tokenizer_from_meta(meta)))[ids]
    return {"tokenizer": tok, "vocab": meta["vocab_size"], "val_docs": meta["val_documents"],
            "val_bytes": int(counts.sum()), "val_tokens": int((counts > 0).sum()),
            "bytes_per_token": counts.sum() / (counts > 0).sum(), "train_s": float(trained[1]) if trained else None,
            "prepare_s": seconds, "peak_rss_mib": usage.ru_maxrss / 1024}


def train_and_eval(runs: list[tuple[Path, Path]], iters: int) -> list[str]:
    """Train each (data, out) run, all at once, one thread each (a loaded machine shares its cores per
    process), then eval.py each on its whole val split; returns eval.py's lines."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "train.py", "config/train_shakespeare_char_cpu.py", f"--data_dir={data}",
                               f"--out_dir={out}", f"--max_iters={iters}", f"--lr_decay_iters={iters}",
                               f"--warmup_iters={iters // 20}", f"--eval_interval={iters}", "--eval_iters=2"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for data, out in runs]
    for p in procs:
        if p.wait():
            raise SystemExit(f"train.py failed:\n{p.stderr.read()[-2000:]}")
    procs = [subprocess.Popen([sys.executable, "eval.py", f"--out_dir={out}", "--device=cpu"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _, out in runs]
    return [p.communicate()[0].strip() for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--vocabs", default="4096,8192,16384")
    ap.add_argument("--train_iters", type=int, default=0)
    ap.add_argument("--train_vocab", type=int, default=8192)
    ap.add_argument("--val_fraction", type=float, default=0.1)
    args = ap.parse_args()
    work = Path(args.work)
    stdlib = Path(sysconfig.get_paths()["stdlib"])  # code: the top-level modules of the running Python's library
    corpora = {"code": str(stdlib / "*.py"), "chinese": chinese_corpus(work)}
    runs = []
    for name, inputs in corpora.items():
        for tok in ["gpt2"] + [f"bpe:{v}" for v in args.vocabs.split(",")]:
            r = prepare(inputs, tok, work / f"{name}-{tok.replace(':', '')}", args.val_fraction)
            print(json.dumps({"corpus": name, **r}), flush=True)
        runs += [(name, tok) for tok in ("gpt2", f"bpe{args.train_vocab}")] if args.train_iters else []
    if runs:
        lines = train_and_eval([(work / f"{c}-{t}", work / f"run-{c}-{t}") for c, t in runs], args.train_iters)
        for (c, t), line in zip(runs, lines):
            print(json.dumps({"corpus": c, "tokenizer": t, "iters": args.train_iters, "eval": line}), flush=True)


if __name__ == "__main__":
    main()
