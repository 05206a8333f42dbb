"""A run in llama.cpp's runtime, against ours: export, GGUF, then logits on val text and greedy text.

    bash scripts/build_llama_cpp.sh                           # once: llama-simple and llama-cpp-logits
    python scripts/compare_llama_cpp.py --out_dir=out-shakespeare-char-cpu --data_dir=data/shakespeare_char

The run goes through the commands a user runs: export.py (float32 folder), scripts/convert_to_gguf.py
(f32 GGUF), sample.py --temperature=0. Then:
- logits: the first --tokens ids of the val split through our model (float32) and through llama.cpp
  (llama-cpp-logits, scripts/llama_cpp_logits.cpp): the largest |difference|, how often the two argmaxes
  agree, and each side's perplexity on those ids;
- greedy text: sample.py's continuation of --start against llama-simple's (llama.cpp's own tokenizer
  reads the prompt, so its pre-tokenizer is compared too).
Prints one JSON line. Opt-in, outside the tests: it needs the build, minutes of compiling on two cores.
"""
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: the repository's core/

from core.config import parse_args  # noqa: E402
from core.data.loader import TokenData  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402
from core.weights.resolver import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEPARATOR = "\n---------------\n"  # sample.py's line after each sample


@dataclasses.dataclass
class CompareConfig:
    out_dir: str = ""              # the run (ckpt.pt)
    data_dir: str = ""             # its dataset; "": the run's config.json data_dir
    start: str = "ROMEO:"          # the prompt of the greedy texts
    max_new_tokens: int = 40       # of each greedy text
    tokens: int = 0                # val ids whose logits are compared; 0: the model's block_size
    build_dir: str = ""            # scripts/build_llama_cpp.sh's; "": $LLAMA_CPP_BUILD_DIR, else its default
    work_dir: str = ""             # for the folder, the GGUF and the logits; "": a temporary folder

    def validate(self) -> None:
        if not self.out_dir:
            raise UserError("pass --out_dir=RUN, a run with a ckpt.pt")


def build_dir(given: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanogpt" / "llama.cpp-build"
    path = Path(given or os.environ.get("LLAMA_CPP_BUILD_DIR") or cache)
    for tool in ("llama-simple", "llama-cpp-logits"):
        if not (path / "bin" / tool).is_file():
            raise UserError(f"{path / 'bin' / tool} not found; run bash scripts/build_llama_cpp.sh first")
    return path


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT, **kw)
    if result.returncode != 0:
        raise UserError(f"{Path(str(cmd[1] if cmd[0] == sys.executable else cmd[0])).name} failed: "
                        f"{(result.stderr.strip().splitlines() or ['(no message)'])[-1]}")
    return result


def our_logits(out_dir: str, ids: list[int]) -> np.ndarray:
    model, _, _ = load_model("resume", out_dir)
    with torch.no_grad():
        return model.float().eval()(torch.tensor([ids]))[0][0].numpy()  # (T, V)


def their_logits(tools: Path, gguf: Path, ids: list[int], work: Path) -> np.ndarray:
    (work / "ids.txt").write_text(" ".join(map(str, ids)))
    run([tools / "bin" / "llama-cpp-logits", gguf, work / "ids.txt", work / "logits.f32"])
    return np.fromfile(work / "logits.f32", dtype=np.float32).reshape(len(ids), -1)  # (T, V)


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean loss of predicting ids[1:] from the rows before them."""
    x = logits[:-1].astype(np.float64)
    logz = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return float(np.exp(np.mean(logz - x[np.arange(len(ids) - 1), ids[1:]])))


def greedy_texts(cfg: CompareConfig, tools: Path, gguf: Path) -> tuple[str, str]:
    ours = run([sys.executable, "sample.py", f"--out_dir={cfg.out_dir}", f"--start={cfg.start}", "--temperature=0",
                "--num_samples=1", f"--max_new_tokens={cfg.max_new_tokens}", "--device=cpu", "--dtype=float32",
                "--stream=False"]).stdout.split(SEPARATOR)[0].rstrip("\n")
    theirs = run([tools / "bin" / "llama-simple", "-m", gguf, "-n", cfg.max_new_tokens, cfg.start]).stdout
    return ours, theirs.rstrip("\n")


def compare(cfg: CompareConfig, work: Path) -> dict:
    tools = build_dir(cfg.build_dir)
    run_config = json.loads((Path(cfg.out_dir) / "config.json").read_text())
    data_dir = cfg.data_dir or run_config["data_dir"]
    hf_dir, gguf = work / "hf", work / "model-f32.gguf"
    run([sys.executable, "export.py", f"--out_dir={cfg.out_dir}", f"--hf_dir={hf_dir}"])
    run([sys.executable, "scripts/convert_to_gguf.py", f"--hf_dir={hf_dir}", f"--gguf={gguf}"])
    n = cfg.tokens or run_config["block_size"]
    val = TokenData(data_dir, "val", n - 1)
    ids = np.fromfile(val.paths[0], dtype=val.dtype, count=n).astype(np.int64).tolist()
    ours, theirs = our_logits(cfg.out_dir, ids), their_logits(tools, gguf, ids, work)
    v = min(ours.shape[1], theirs.shape[1])  # ours may hold padding rows past the tokenizer's ids
    text_ours, text_theirs = greedy_texts(cfg, tools, gguf)
    same = next((i for i, (a, b) in enumerate(zip(text_ours, text_theirs)) if a != b), min(len(text_ours), len(text_theirs)))
    return {"out_dir": cfg.out_dir, "positions": n, "vocab": [ours.shape[1], theirs.shape[1]],
            "max_abs_logit_diff": float(np.abs(ours[:, :v] - theirs[:, :v]).max()),
            "logit_scale": float(np.abs(ours[:, :v]).max()),
            "argmax_agree": float((ours[:, :v].argmax(-1) == theirs[:, :v].argmax(-1)).mean()),
            "perplexity": [perplexity(ours[:, :v], ids), perplexity(theirs[:, :v], ids)],
            "greedy_equal": text_ours == text_theirs, "greedy_same_chars": same,
            "greedy": [text_ours, text_theirs]}


def main(argv: Sequence[str]) -> dict:
    cfg = parse_args(CompareConfig, argv)
    if cfg.work_dir:
        Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
        report = compare(cfg, Path(cfg.work_dir))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = compare(cfg, Path(tmp))
    print(json.dumps(report, ensure_ascii=False))
    return report


if __name__ == "__main__":
    run_cli(main)
