"""Proof that chat fine-tuning learns: held-out exact-answer accuracy of the base model, the base after
SFT, and the same SFT with the loss mask off, with the wall and CPU time of each step (docs/chat.md).

    python scripts/chat_proof.py                       # needs the base run: the README's CPU quick start
    python scripts/chat_proof.py --max_iters=300       # shorter fine-tunes

Runs from the repo root: data/chat/tasks.py, prepare.py, train.py twice at once (mask on and off, a thread each),
eval.py --task=chat on each, and scores the base model itself (chat tokens grown, never trained). A markdown table.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repo importable

from core.data.chat import ChatTemplate  # noqa: E402
from core.data.loader import read_meta  # noqa: E402
from core.data.tokenizer import tokenizer_from_meta  # noqa: E402
from core.evaluation.answers import chat_accuracy, load_chat_file  # noqa: E402
from core.weights import checkpoint

BASE = "out-shakespeare-char-cpu"
HELDOUT = "data/chat/tasks_heldout.jsonl"
TRAIN_ARGS = ["config/train_shakespeare_char_cpu.py", "config/sft_tasks_char.py"]


def run(cmd: list[str]) -> str:
    result = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: python {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return result.stdout


def run_timed(cmds: list[list[str]], while_running) -> list:
    """Run the commands at once (one thread each: OMP_NUM_THREADS=1) and while_running() here meanwhile;
    (wall s, CPU s) of each command, then while_running's result."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    procs = {subprocess.Popen([sys.executable, *cmd], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True).pid: i for i, cmd in enumerate(cmds)}
    times = [None] * len(cmds)
    result = while_running()
    while procs:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in procs:
            continue
        i = procs.pop(pid)
        if os.waitstatus_to_exitcode(status):
            sys.exit(f"failed: python {' '.join(cmds[i])}")
        times[i] = (time.perf_counter() - t0, usage.ru_utime + usage.ru_stime)
    return times + [result]


def base_accuracy() -> str:
    """The base model on the held-out tasks, with the chat tokens added (mean-initialised rows)."""
    model = checkpoint.model_from_checkpoint(checkpoint.load_checkpoint(Path(BASE) / checkpoint.CKPT_NAME))
    tok = tokenizer_from_meta(read_meta("data/chat"))
    model.grow_vocab(tok.vocab_size)
    r = chat_accuracy(model, ChatTemplate.for_tokenizer(tok), load_chat_file(HELDOUT))
    return f"{r['accuracy']:.4f} ({r['correct']}/{r['examples']})"


def main(argv: list[str]) -> None:
    run(["data/chat/tasks.py"])
    run(["data/chat/prepare.py", "--input=data/chat/tasks_train.jsonl", f"--tokenizer_from={BASE}", "--block_size=64"])
    runs = (("SFT, loss on assistant tokens", "out-sft-tasks-char", []),
            ("SFT, loss on every token (mask off)", "out-sft-tasks-char-nomask", ["--loss_mask=False"]))
    times = run_timed([["train.py", *TRAIN_ARGS, f"--out_dir={out_dir}", *extra, *argv] for _, out_dir, extra in runs],
                      while_running=base_accuracy)
    rows = [("base (no fine-tune)", "-", "-", times.pop())]
    for (name, out_dir, _), (wall, cpu) in zip(runs, times):
        line = run(["eval.py", f"--out_dir={out_dir}", "--task=chat", f"--chat_file={HELDOUT}"])
        rows.append((name, f"{wall:.0f}", f"{cpu:.0f}", line.split("accuracy ")[1].strip()))
    print("| model | fine-tune wall s | fine-tune CPU s | held-out exact-answer accuracy |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
