"""Serving under load: aggregate tokens/s and time to first token at N concurrent streaming clients, for
serve.py (a real process, real HTTP) against the same rows batched in-process through BatchEngine (the
ceiling: no HTTP, no JSON, no event loop).

    python benchmarks/serve_load.py                       # quick-start shape, 1 4 16 64 clients, both sides
    python benchmarks/serve_load.py --shape=gpt2 --clients=1,16 --new_tokens=32

Every client streams one /v1/completions request of new_tokens tokens (temperature 1, its own seed,
no stop), all sent at once. The last line of stdout is one JSON document: a row per (shape, clients).
Pure functions (in_process, over_http, summary) so that bench.py's serve section can call them.
"""
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.engine import BatchEngine, EngineRequest, engine_sampling  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

SHAPES = {"quickstart": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65),  # config/..._cpu.py
          "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)}
PROMPT = [1, 2, 3, 4, 5, 6]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(clients: int, new_tokens: int, seconds: float, ttfts: list[float]) -> dict:
    return {"clients": clients, "tokens_per_s": clients * new_tokens / seconds, "seconds": seconds,
            "ttft_p50_ms": 1000 * percentile(ttfts, 0.5), "ttft_p95_ms": 1000 * percentile(ttfts, 0.95)}


def in_process(model: GPT, clients: int, new_tokens: int, max_batch: int) -> dict:
    """The same rows through a BatchEngine in this process: the ceiling the server is held to."""
    engine = BatchEngine(model, max_batch, max(1, model.config.block_size // 2), model.config.vocab_size)

    async def one(seed, loop, t0):
        req = EngineRequest(PROMPT, 1, new_tokens, engine_sampling(1.0, None, None, seed, "cpu", None,
                                                                     engine.window_shift, engine.vocab_size))
        first = None
        async for _ in engine.submit(req, loop).events():
            first = first or time.perf_counter() - t0
        return first

    async def every():
        loop, t0 = asyncio.get_running_loop(), time.perf_counter()
        ttfts = await asyncio.gather(*(one(s, loop, t0) for s in range(clients)))
        return time.perf_counter() - t0, ttfts

    engine.start()
    try:
        seconds, ttfts = asyncio.run(every())
    finally:
        engine.stop()
        engine.thread.join()
    return summary(clients, new_tokens, seconds, list(ttfts))


def over_http(url: str, name: str, clients: int, new_tokens: int) -> dict:
    """clients concurrent streaming /v1/completions requests against a running serve.py."""
    import httpx

    async def one(client, seed, t0):
        body = {"model": name, "prompt": PROMPT, "max_tokens": new_tokens, "temperature": 1.0, "seed": seed,
                "stream": True}
        first = None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - t0
        return first

    async def every():
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.perf_counter()
            ttfts = await asyncio.gather(*(one(client, s, t0) for s in range(clients)))
            return time.perf_counter() - t0, ttfts

    seconds, ttfts = asyncio.run(every())
    return summary(clients, new_tokens, seconds, list(ttfts))


def start_server(ckpt_dir: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "serve.py", "--init_from=" + ckpt_dir, f"--port={port}", "--device=cpu",
                             "--dtype=float32", f"--max_batch={max_batch}", "--model_name=m",
                             "--max_tokens_limit=100000"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("serve.py did not start")


def main(argv: list[str]) -> None:
    args = dict(a.lstrip("-").split("=", 1) for a in argv)
    shapes = args.get("shape", "quickstart").split(",")
    clients = [int(c) for c in args.get("clients", "1,4,16,64").split(",")]
    new_tokens, max_batch = int(args.get("new_tokens", 64)), int(args.get("max_batch", 64))
    torch.set_num_threads(1)
    rows = []
    for shape in shapes:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SHAPES[shape])).eval()  # speed does not depend on the weights
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)  # a transformers folder, whose char-less vocabulary serve.py reads ids of
            _write_tokenizer(d, model.config.vocab_size)
            proc, url = start_server(d, max_batch)
            try:
                for n in clients:  # alternate the two sides at each count: the load drifts less between them
                    ceiling = in_process(model, n, new_tokens, max_batch)
                    server = over_http(url, "m", n, new_tokens)
                    rows.append({"shape": shape, "clients": n, "server": server, "in_process": ceiling,
                                 "time_ratio": server["seconds"] / ceiling["seconds"]})
                    print(f"{shape} {n:3d} clients: server {server['tokens_per_s']:8.1f} tok/s "
                          f"(TTFT p50 {server['ttft_p50_ms']:.0f} ms, p95 {server['ttft_p95_ms']:.0f} ms), "
                          f"in-process {ceiling['tokens_per_s']:8.1f} tok/s, time ratio {rows[-1]['time_ratio']:.2f}",
                          file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(30)
    print(json.dumps(rows))


def _write_tokenizer(directory: str, vocab_size: int) -> None:
    """A tokenizer beside the weights, so serve.py can load the folder: GPT-2's BPE for a GPT-2-sized
    vocabulary (TIKTOKEN_CACHE_DIR offline), else vocab_size characters."""
    from core.hf_tokenizer import save_hf_tokenizer
    from core.tokenizer import CharTokenizer, GPT2Tokenizer

    tok = GPT2Tokenizer() if vocab_size > 50000 else CharTokenizer([chr(0x100 + i) for i in range(vocab_size)])
    save_hf_tokenizer(tok, directory, model_max_length=1024)


if __name__ == "__main__":
    main(sys.argv[1:])
