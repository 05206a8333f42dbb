"""Proof that chat fine-tuning learns: held-out exact-answer accuracy of the base model, the base after
SFT, and the same SFT with the loss mask off, with the wall and CPU time of each step (docs/chat.md).

    python scripts/chat_proof.py                       # needs the base run: the README's CPU quick start
    python scripts/chat_proof.py --max_iters=300       # shorter fine-tunes

Runs, from the repo root: data/chat/tasks.py, data/chat/prepare.py, train.py twice (mask on, mask off),
eval.py --task=chat on each, and scores the base model itself (its weights, the chat tokens added as
grow_vocab adds them, never trained on). Prints a markdown table.
"""
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repo importable

from core import checkpoint, evaluate  # noqa: E402
from core.chat import ChatTemplate  # noqa: E402
from core.data import read_meta  # noqa: E402
from core.tokenizer import tokenizer_from_meta  # noqa: E402

BASE = "out-shakespeare-char-cpu"
HELDOUT = "data/chat/tasks_heldout.jsonl"
TRAIN_ARGS = ["config/train_shakespeare_char_cpu.py", "config/sft_tasks_char.py"]


def run(cmd: list[str]) -> tuple[float, float, str]:
    """Run `python cmd...`; (wall seconds, CPU seconds of the child, its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        sys.exit(f"failed: python {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), result.stdout


def base_accuracy() -> str:
    """The base model on the held-out tasks, with the chat tokens added (mean-initialised rows)."""
    state = checkpoint.load_checkpoint(Path(BASE) / checkpoint.CKPT_NAME)
    model = checkpoint.model_from_checkpoint(state)
    tok = tokenizer_from_meta(read_meta("data/chat"))
    model.grow_vocab(tok.vocab_size)
    r = evaluate.chat_accuracy(model, ChatTemplate.for_tokenizer(tok), evaluate.load_chat_file(HELDOUT))
    return f"{r['accuracy']:.4f} ({r['correct']}/{r['examples']})"


def main(argv: list[str]) -> None:
    run(["data/chat/tasks.py"])
    run(["data/chat/prepare.py", "--input=data/chat/tasks_train.jsonl", f"--tokenizer_from={BASE}", "--block_size=64"])
    rows = [("base (no fine-tune)", "-", "-", base_accuracy())]
    for name, out_dir, extra in (("SFT, loss on assistant tokens", "out-sft-tasks-char", []),
                                 ("SFT, loss on every token", "out-sft-tasks-char-nomask", ["--loss_mask=False"])):
        wall, cpu, _ = run(["train.py", *TRAIN_ARGS, f"--out_dir={out_dir}", *extra, *argv])
        _, _, line = run(["eval.py", f"--out_dir={out_dir}", "--task=chat", f"--chat_file={HELDOUT}"])
        rows.append((name, f"{wall:.0f}", f"{cpu:.0f}", line.split("accuracy ")[1].strip()))
        print(f"{name}: {rows[-1]}", file=sys.stderr)
    print("| model | train wall s | train CPU s | held-out exact-answer accuracy |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
