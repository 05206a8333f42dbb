"""lm-evaluation-harness's perplexity task three ways on one run (docs/evaluation.md's table and why hf's max_length
is two less than the context): `--model hf` on export.py's folder, `--model local-completions` against serve.py with
the folder's tokenizer, and with serve.py's own tokenizer endpoints. Prints one markdown row of bits per byte: the
three, hf at the whole context, and the spread of the three.

    python scripts/lm_eval_three_ways.py --out_dir=out-shakespeare-char-cpu --name="characters"
    python scripts/lm_eval_three_ways.py --out_dir=out-bpe --name="trained BPE" --task=shakespeare_rolling

lm_eval's max_length is what /v1/models reports (docs/serving.md). One thread for the server, one for lm_eval.
"""
import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, seconds: float = 120) -> dict:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve.py exited with {proc.returncode}")
        try:
            return json.load(urllib.request.urlopen(url, timeout=2))
        except OSError:
            time.sleep(0.5)
    sys.exit(f"serve.py did not answer {url} in {seconds:.0f}s")


def lm_eval(task: str, model: str, model_args: dict) -> float:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    result = simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=1, bootstrap_iters=0,
                             task_manager=TaskManager(include_path=str(TASKS)))
    return result["results"][task]["bits_per_byte,none"]


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(description="lm-eval's perplexity task three ways on one run")
    parser.add_argument("--out_dir", required=True, help="the run (its ckpt.pt)")
    parser.add_argument("--name", help="the table row's name (default: out_dir)")
    parser.add_argument("--task", default="shakespeare_rolling", help="a task of tests/lm_eval_tasks")
    args = parser.parse_args(argv)
    out_dir, name, task = args.out_dir, args.name or args.out_dir, args.task
    hf_dir = Path(tempfile.mkdtemp()) / "hf"
    subprocess.run([sys.executable, "export.py", f"--out_dir={out_dir}", f"--hf_dir={hf_dir}"], cwd=ROOT, check=True)
    port = free_port()
    server = subprocess.Popen([sys.executable, "serve.py", f"--out_dir={out_dir}", "--model_name=m", f"--port={port}",
                               "--threads=1"], cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        context = wait_for(base + "/v1/models", server)["data"][0]["context_length"]
        local = dict(model="m", base_url=base + "/v1/completions", tokenized_requests=True, num_concurrent=1,
                     max_retries=1, max_length=context)
        hf = dict(pretrained=str(hf_dir), device="cpu", dtype="float32")
        bits = [lm_eval(task, "hf", hf | dict(max_length=context - 2)),  # the API model's windows (docs/evaluation.md)
                lm_eval(task, "local-completions", local | dict(tokenizer=str(hf_dir), tokenizer_backend="huggingface")),
                lm_eval(task, "local-completions", local),
                lm_eval(task, "hf", hf | dict(max_length=context))]
    finally:
        server.terminate()
        server.wait(30)
    row = f"| {name} | " + " | ".join(f"{b:.4f}" for b in bits) + f" | {max(bits[:3]) - min(bits[:3]):.5f} |"
    print(row)
    return row


if __name__ == "__main__":
    main(sys.argv[1:])
