"""The tables of docs/tokenizers.md: trained BPEs against GPT-2's BPE on two corpora that are not English prose.

    python scripts/tokenizer_proof.py --work=/tmp/tokproof                 # tokenizer tables only
    python scripts/tokenizer_proof.py --work=/tmp/tokproof --train_iters=300   # and the training runs

Corpora:
    code     Python's standard library source: the top-level *.py of the running Python's lib folder
             (one document per file)
    chinese  the zh_CN translations (msgstr) of the gettext catalogs the system's packages install in
             /usr/share/locale/zh_CN/LC_MESSAGES/*.mo: one document per catalog

For each corpus and tokenizer, data/text/prepare.py runs as its own process (peak RSS from wait4,
training time from its own line); bytes per token are measured on the val split (whole documents the
BPE never saw). With --train_iters, train.py runs config/train_shakespeare_char_cpu.py's model for that
many iterations on GPT-2's BPE and on one trained BPE (the same tokens per iteration, so equal compute
in the transformer blocks), and eval.py gives bits per byte on the val split.
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

from core.tokenizer import token_bytes, tokenizer_from_meta  # noqa: E402

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


def code_corpus() -> str:
    return str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")


def prepare(inputs: str, tok: str, out: Path) -> dict:
    cmd = [sys.executable, "data/text/prepare.py", f"--input={inputs}", f"--tokenizer={tok}", f"--out_dir={out}"]
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


def train_and_eval(data: Path, out: Path, iters: int) -> str:
    train = [sys.executable, "train.py", "config/train_shakespeare_char_cpu.py", f"--data_dir={data}",
             f"--out_dir={out}", f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--eval_interval={iters}",
             "--eval_iters=5", f"--log_interval={max(1, iters // 4)}"]
    subprocess.run(train, cwd=ROOT, check=True, capture_output=True, text=True)
    ev = subprocess.run([sys.executable, "eval.py", f"--out_dir={out}", "--device=cpu"], cwd=ROOT, check=True,
                        capture_output=True, text=True)
    return ev.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--vocabs", default="4096,8192,16384")
    ap.add_argument("--train_iters", type=int, default=0)
    ap.add_argument("--train_vocab", type=int, default=8192)
    args = ap.parse_args()
    work = Path(args.work)
    corpora = {"code": code_corpus(), "chinese": chinese_corpus(work)}
    results = {}
    for name, inputs in corpora.items():
        for tok in ["gpt2"] + [f"bpe:{v}" for v in args.vocabs.split(",")]:
            r = prepare(inputs, tok, work / f"{name}-{tok.replace(':', '')}")
            results[f"{name} {tok}"] = r
            print(json.dumps({"corpus": name, **r}), flush=True)
        if args.train_iters:
            for tok in ("gpt2", f"bpe{args.train_vocab}"):
                line = train_and_eval(work / f"{name}-{tok}", work / f"run-{name}-{tok}", args.train_iters)
                print(json.dumps({"corpus": name, "tokenizer": tok, "iters": args.train_iters, "eval": line}), flush=True)


if __name__ == "__main__":
    main()
