"""Serving: serve.py over HTTP against the same generations run in this process.

serve.py runs as its own process on a loopback port, serving the decode section's model (random
weights, a stand-in character vocabulary) from a temporary checkpoint. For each count in
serve_clients, that many concurrent /v1/completions requests (one per client, sampled with their own
seeds, serve_max_tokens new tokens each) against the same generations run in this process, one
model.generate after another: requests/s and tokens/s, the wall-time ratio (the server's overhead),
and CPU seconds (the server's from /proc, the client's and the in-process model's from this process),
which a loaded machine disturbs less than wall time.
"""
import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import decode
from benchmarks.common import ROOT, at_least, int_list, median_time, num, section_list
from core import checkpoint, markdown, runtime
from core.errors import UserError
from core.tokenizer import CharTokenizer
from model import GPT, window_shift


@dataclasses.dataclass
class Settings:
    serve_clients: str = "1,4,16"  # concurrent clients, one request each
    serve_max_tokens: int = 64     # new tokens per request (sampled, temperature 1, no stop: always this many)
    serve_prompt_len: int = 16


def check(cfg) -> None:
    at_least(cfg, 1, "serve_max_tokens", "serve_prompt_len")
    int_list(cfg.serve_clients, "serve_clients")
    if "serve" in section_list(cfg) and cfg.serve_prompt_len > cfg.decode_block_size:
        raise UserError(f"serve_prompt_len {cfg.serve_prompt_len} is longer than "
                        f"decode_block_size {cfg.decode_block_size}")


def serve_checkpoint(cfg, out_dir: Path) -> tuple[GPT, CharTokenizer, str]:
    """The decode section's model (random weights) saved as a checkpoint serve.py can load, with a character
    vocabulary of decode_vocab_size stand-in characters; returns the model, the tokenizer and a prompt."""
    torch.manual_seed(cfg.seed)
    mc = decode.model_config(cfg)
    model = GPT(mc)
    tok = CharTokenizer([chr(0x100 + i) for i in range(mc.vocab_size)])  # any distinct printable characters
    checkpoint.save_checkpoint(out_dir, {"model_args": dataclasses.asdict(mc), "tokenizer": tok.meta(), "iter_num": 0},
                               model.state_dict())
    prompt = tok.decode([i % mc.vocab_size for i in range(cfg.serve_prompt_len)])
    return model, tok, prompt


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) another process has used so far; None where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def start_server(cfg, rt: runtime.Runtime, out_dir: Path, port: int):
    import httpx
    threads = str(cfg.threads or os.cpu_count())  # the same torch threads as this process
    env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    log = open(out_dir / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), f"--out_dir={out_dir}",
                             "--model_name=bench", f"--port={port}", f"--device={rt.device}", f"--dtype={rt.dtype}",
                             f"--max_tokens_limit={cfg.serve_max_tokens}", "--max_n=1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        time.sleep(0.2)
    proc.kill()
    raise UserError(f"serve.py did not start for the serve section:\n{(out_dir / 'serve.log').read_text()[-2000:]}")


def clients_row(cfg, rt: runtime.Runtime, model: GPT, tok: CharTokenizer, prompt: str, server, port: int,
                c: int) -> dict:
    """c concurrent requests to the server against the same c generations in this process."""
    import httpx

    def in_process():  # what the server does for c requests, without HTTP: one generate each
        ids = torch.tensor([tok.encode(prompt)], device=rt.device)  # (1, T)
        for seed in range(c):
            model.generate(ids, cfg.serve_max_tokens, temperature=1.0, vocab_size=tok.vocab_size,
                           generator=torch.Generator(device=rt.device).manual_seed(seed),
                           window_shift=window_shift(None, model.config.block_size))

    async def requests():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json={
                "model": "bench", "prompt": prompt, "max_tokens": cfg.serve_max_tokens,
                "temperature": 1.0, "seed": seed}) for seed in range(c)))
        for r in replies:
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != cfg.serve_max_tokens:
                raise UserError(f"serve.py answered {r.status_code}: {r.text[:300]}")

    row = {"clients": c, "tokens": c * cfg.serve_max_tokens}
    for way, fn in (("in_process", in_process), ("server", lambda: asyncio.run(requests()))):
        cpu0, server0 = time.process_time(), process_cpu_s(server.pid)
        row[f"{way}_s"] = median_time(fn, cfg.warmup, cfg.repeats, rt.synchronize)
        runs = cfg.warmup + cfg.repeats
        # this process's CPU: the model in-process; the HTTP client for the server
        row["in_process_cpu_s" if way == "in_process" else "server_client_cpu_s"] = (time.process_time() - cpu0) / runs
        if way == "server" and server0 is not None:
            row["server_cpu_s"] = (process_cpu_s(server.pid) - server0) / runs
    return row | {"requests_per_s": c / row["server_s"], "tokens_per_s": row["tokens"] / row["server_s"],
                  "in_process_tokens_per_s": row["tokens"] / row["in_process_s"],
                  "overhead": row["server_s"] / row["in_process_s"]}


def measure(cfg, rt: runtime.Runtime) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, prompt = serve_checkpoint(cfg, Path(tmp))
        model = runtime.inference_model(model, rt)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_server(cfg, rt, Path(tmp), port)
        try:
            rows = [clients_row(cfg, rt, model, tok, prompt, server, port, c)
                    for c in int_list(cfg.serve_clients, "serve_clients")]
        finally:
            server.terminate()
            server.wait(60)
    mc = model.config
    return {"model": f"{mc.n_layer} layers x {mc.n_embd} wide, {mc.n_head} heads, block_size {mc.block_size}, "
                     f"vocab {mc.vocab_size}", "params": model.get_num_params(), "prompt_tokens": cfg.serve_prompt_len,
            "max_tokens": cfg.serve_max_tokens, "repeats": cfg.repeats, "rows": rows}


def table(r: dict) -> str:
    rows = []
    for row in r["rows"]:
        server_cpu = row.get("server_cpu_s")
        rows.append([row["clients"], num(row["requests_per_s"], 2), num(row["tokens_per_s"], 1),
                     num(row["in_process_tokens_per_s"], 1), f"{row['overhead']:.2f}x", num(row["in_process_cpu_s"], 2),
                     "n/a" if server_cpu is None else num(server_cpu, 2), num(row["server_client_cpu_s"], 2),
                     "n/a" if server_cpu is None else
                     f"{(server_cpu + row['server_client_cpu_s']) / row['in_process_cpu_s']:.2f}x"])
    return (f"### Serving: serve.py over HTTP against the same generations in-process\n{r['model']}; "
            f"{r['params'] / 1e6:.2f}M parameters; each client sends one /v1/completions request at once "
            f"({r['prompt_tokens']}-token prompt, {r['max_tokens']} new tokens, sampled); in-process: the same "
            f"generations one model.generate after another; wall: median of {r['repeats']}; CPU: seconds per run\n\n"
            + markdown.table(["clients", "requests/s", "tokens/s", "in-process tokens/s", "wall ratio",
                              "in-process CPU s", "server CPU s", "client CPU s", "CPU ratio"], rows))
