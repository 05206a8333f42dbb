"""Serving under load: serve.py over HTTP against the same rows batched in this process, the ceiling.

serve.py runs as its own process on a loopback port (the bench's torch threads, device and dtype) and loads a temporary
checkpoint of random weights (speed does not depend on them) in the serve_shape of Settings (gpt2's BPE offline:
TIKTOKEN_CACHE_DIR). For each count in serve_clients, that many clients each stream one /v1/completions request at once
(a serve_prompt_len-token prompt, serve_max_tokens new tokens, sampled at temperature 1 with no seed as load tools send
them, no stop), against the same requests submitted at once to a BatchEngine in this process (no HTTP, no JSON, no
text), with the same serve_max_batch and threads: the ceiling. The two sides alternate at each count, each repeat, so
the load drifts less between them. Then the prefix cache: a serve_prefix_tokens-token prompt sent twice to the first
server, each time's time to first token, and whether the second's greedy text is the first's. And what serve.py's
--step_tokens trades, in this process: the CPU time per prompt token by chunk size, beside a decoding step's
(budget_rows).

Each side: aggregate tokens/s, time to first token at p50 and p95, wall seconds and CPU seconds (the server's from
/proc, the in-process engine's from this process; the HTTP clients' CPU, also this process's, is reported apart), every
figure the median of the repeats. The time ratio is the server's wall time over the in-process one (its goal:
docs/serving.md, "Throughput"); the CPU ratio, which a loaded machine disturbs less, is the server's CPU seconds over
the in-process ones.

    python bench.py --sections=serve                                    # quick start, 1 4 16 64 clients
    TIKTOKEN_CACHE_DIR=path/to/tiktoken_cache python bench.py --sections=serve --serve_shape=gpt2 \\
        --serve_max_tokens=16 --serve_max_batch=16 --repeats=1          # GPT-2 small's shape
    python bench.py --sections=serve --serve_shape=gpt2 --serve_quantize=int8 ...   # int8 weights on both sides
"""
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

import torch

from benchmarks.common import ROOT, int_list, markdown_table, num, num_threads, some_of, spec_list
from core import runtime
from core.config import at_least, read_config_file
from core.data.tokenizer import CharTokenizer, GPT2Tokenizer, Tokenizer
from core.decoding.cache import RowCache, Segments
from core.decoding.decode import inference_model, window_shift
from core.decoding.quantize import check_quantize
from core.errors import UserError
from core.serving.engine import BatchEngine, EngineRequest, EngineSettings, engine_sampling
from core.training import checkpointing
from model import GPT, GPTConfig

QUICKSTART = "config/train_shakespeare_char_cpu.py"
SHAPES = ("quickstart", "gpt2")


@dataclasses.dataclass
class Settings:
    serve_shape: str = "quickstart"  # quickstart (QUICKSTART's model, 65 symbols) or gpt2 (GPT-2 small, its BPE)
    serve_clients: str = "1,4,16,64"  # concurrent streaming clients, one request each
    serve_max_tokens: int = 64       # new tokens per request (sampled, no stop: always this many)
    serve_prompt_len: int = 6
    serve_max_batch: int = 64        # serve.py's --max_batch and the in-process engine's: rows decoded at once
    serve_engines: str = "process,thread"  # serve.py's --engine for each server measured, side by side
    serve_client: str = "lean"       # the HTTP clients: lean (lean_stream, asyncio's streams) or httpx
    serve_quantize: str = "none"     # int8 | int4: serve.py --quantize and the in-process engine's model alike
    serve_prefix_tokens: int = 1000  # a prompt this long (at most the context less 16 new tokens) sent twice


PRESETS = {"gpt2": dict(serve_shape="gpt2")}


def check(cfg) -> None:
    at_least(cfg, 1, "serve_max_tokens", "serve_prompt_len", "serve_max_batch", "serve_prefix_tokens")
    int_list(cfg.serve_clients, "serve_clients")
    some_of(cfg.serve_engines, ("auto", "process", "thread"), "serve_engines")
    if cfg.serve_client not in ("lean", "httpx"):
        raise UserError(f"serve_client must be lean or httpx, got '{cfg.serve_client}'")
    check_quantize(cfg.serve_quantize)
    if cfg.serve_shape not in SHAPES:
        raise UserError(f"serve_shape must be one of {', '.join(SHAPES)}, got '{cfg.serve_shape}'")
    block_size = model_config(cfg.serve_shape).block_size
    if "serve" in spec_list(cfg.sections) and cfg.serve_prompt_len > block_size:
        raise UserError(f"serve_prompt_len {cfg.serve_prompt_len} is longer than the {cfg.serve_shape} model's "
                        f"block_size {block_size}")


def preflight(cfg) -> None:
    if cfg.serve_shape == "gpt2":
        GPT2Tokenizer()  # fail now, not after minutes of measuring, if the BPE file cannot be loaded


def model_config(shape: str) -> GPTConfig:
    if shape == "gpt2":
        return GPTConfig()  # GPT-2 small, its vocabulary padded to 50304
    quick = read_config_file(str(ROOT / QUICKSTART))
    return GPTConfig(vocab_size=65, **{k: quick[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "dropout")})


def serve_checkpoint(cfg, out_dir: Path) -> tuple[GPT, Tokenizer]:
    """A model of random weights in the chosen shape, saved where serve.py --out_dir loads it."""
    torch.manual_seed(cfg.seed)
    mc = model_config(cfg.serve_shape)
    model = GPT(mc)
    tok = GPT2Tokenizer() if cfg.serve_shape == "gpt2" else CharTokenizer([chr(0x100 + i) for i in range(65)])
    checkpointing.save_checkpoint(out_dir, {"model_args": dataclasses.asdict(mc), "tokenizer": tok.meta(),
                                            "iter_num": 0}, model.state_dict())
    return model, tok


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) another process and its children (serve.py's engine process) have used so
    far; None where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except OSError:
        return None
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return own + sum(process_cpu_s(c) or 0.0 for c in children)


def start_server(cfg, rt: runtime.Runtime, out_dir: Path, engine: str) -> tuple[subprocess.Popen, str]:
    import httpx  # a dev dependency (requirements-dev.txt), needed by this section alone
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = out_dir / f"serve-{engine}.log"
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), f"--out_dir={out_dir}", "--model_name=bench",
                             f"--port={port}", f"--device={rt.device}", f"--dtype={rt.dtype}",
                             f"--threads={torch.get_num_threads()}", f"--max_batch={cfg.serve_max_batch}",
                             f"--max_tokens_limit={cfg.serve_max_tokens}", "--max_n=1", f"--engine={engine}",
                             f"--quantize={cfg.serve_quantize}"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        time.sleep(0.2)
    proc.kill()
    raise UserError(f"serve.py did not start for the serve section:\n{log.read_text()[-2000:]}")


async def at_once(one, clients: int) -> tuple[float, list[float]]:
    """Wall seconds for `clients` calls of one(t0) run at once, and each one's time to first token."""
    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(one(t0) for _ in range(clients)))
    return time.perf_counter() - t0, list(ttfts)


def in_process(engine: BatchEngine, prompt: list[int], clients: int, max_tokens: int) -> tuple[float, list[float]]:
    """The same requests submitted at once to a BatchEngine in this process: the ceiling."""
    async def one(t0):
        sampling = engine_sampling(1.0, None, None, None, engine.device, None, engine.settings.window_shift,
                                   engine.settings.vocab_size)
        first, tokens = None, 0
        async for step in engine.submit(EngineRequest(prompt, 1, max_tokens, sampling), asyncio.get_running_loop()
                                        ).events():
            if isinstance(step, list):  # a step's rows (after the prompt's PromptScores)
                first, tokens = first or time.perf_counter() - t0, tokens + len(step)
        if tokens != max_tokens:
            raise UserError(f"the in-process engine gave {tokens} tokens, not {max_tokens}")
        return first
    return asyncio.run(at_once(one, clients))


async def lean_stream(url: str, path: str, body: dict) -> AsyncIterator[tuple[int, str]]:
    """A POST's (status, line) for each line of its reply, read with asyncio's own streams: HTTP/1.1 with a
    chunked or a sized body, one request per connection. The clients share this machine's cores with the
    server, and httpx's work per streamed chunk is about the server's own, so it would be charged to the
    server's time (serve_client=httpx measures that)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") != "chunked":
            for line in (await reader.read()).decode().splitlines():
                yield status, line
            return
        rest = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            lines = (rest + (await reader.readexactly(size + 2))[:-2]).split(b"\n")
            rest = lines.pop()  # a line not yet ended
            for line in lines:
                yield status, line.decode()
    finally:
        writer.close()


def over_http(url: str, prompt: list[int], clients: int, max_tokens: int,
              client: str = "lean") -> tuple[float, list[float]]:
    """clients concurrent streaming /v1/completions requests, read by lean_stream or by httpx; each one's
    usage is checked. ignore_eos, as the in-process engine is given no stop id: no request stops early."""
    import httpx

    async def lines(c, body):
        if c is None:
            async for status, line in lean_stream(url, "/v1/completions", body):
                yield status, line
            return
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                yield r.status_code, line

    async def one(c, t0):
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        first, usage, status = None, None, None
        async for status, line in lines(c, body):
            if line.startswith("data: {"):
                first = first or time.perf_counter() - t0
                if '"usage": {' in line:  # the last chunk (include_usage)
                    usage = json.loads(line[len("data: "):])["usage"]
        if status != 200 or (usage or {}).get("completion_tokens") != max_tokens:
            raise UserError(f"serve.py answered {status} without {max_tokens} tokens (usage {usage})")
        return first

    async def every():
        if client == "lean":
            return await at_once(lambda t0: one(None, t0), clients)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as c:
            return await at_once(lambda t0: one(c, t0), clients)
    return asyncio.run(every())


def prefix_row(cfg, url: str, vocab: int, block_size: int) -> dict:
    """serve_prefix_tokens' prompt (another each repeat, so that its first time is cold) sent twice, greedy and
    streamed: the medians of the two TTFTs, the tokens the second took from the prefix cache, and whether its text
    was the first's. 16 new tokens at most: the quick start's context (64) holds no more beside a prompt."""
    new = min(cfg.serve_max_tokens, 16)
    n = min(cfg.serve_prefix_tokens, block_size - new)

    async def once(prompt: list[int]) -> dict:
        t0, first, text, usage = time.perf_counter(), None, "", None
        body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        async for status, line in lean_stream(url, "/v1/completions", body):
            if status != 200:
                raise UserError(f"serve.py refused the prefix cache's {n}-token prompt: {line}")
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                first = first or time.perf_counter() - t0
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
        return {"ttft_ms": 1000 * first, "text": text, "cached": usage["prompt_tokens_details"]["cached_tokens"]}
    prompts = [[(7 * i + r) % vocab for i in range(n)] for r in range(cfg.warmup + cfg.repeats)]
    runs = [[asyncio.run(once(prompt)), asyncio.run(once(prompt))] for prompt in prompts][cfg.warmup:]
    cold, warm = (statistics.median(run[k]["ttft_ms"] for run in runs) for k in (0, 1))
    return {"prompt_tokens": n, "cold_ttft_ms": cold, "warm_ttft_ms": warm, "speedup": cold / warm,
            "cached_tokens": statistics.median(run[1]["cached"] for run in runs),
            "same_text": all(run[0]["text"] == run[1]["text"] for run in runs)}


@torch.no_grad()
def budget_rows(model: GPT, repeats: int) -> list[dict]:
    """What serve.py's --step_tokens and --threads trade: the wall and CPU ms of one row's prompt chunk of each size
    (from position 0), of a decoding step of 1, 4 and 16 rows (at position block_size // 4), and of 16 such rows with
    a 128-token chunk beside them in one forward (the engine's step), at this process's threads and at one fewer
    (serve.py's engine default); every shape and count once per repeat, interleaved, medians. On a busy machine the
    second shows what a core left to others saves."""
    cache, T, threads = RowCache(model.new_kv_cache(17)), model.config.block_size, torch.get_num_threads()
    shapes = [(1, c, 0) for c in (16, 32, 64, 128, 256, 512, 1024) if c <= T] + [(b, 1, 0) for b in (1, 4, 16)]
    shapes += [(16, 1, 128)] if T >= 128 else []  # (rows, tokens each, a chunk's tokens beside them)
    counts = sorted({max(1, threads - 1), threads})
    times = {(shape, n): [] for shape in shapes for n in counts}
    for _ in range(repeats + 1):  # the first, warming up, left out
        for (B, chunk, beside), n in times:
            cache.pos[:16], cache.pos[16] = (0 if chunk > 1 else T // 4), 0  # slot 16: the chunk beside
            parts = [(cache.rows(0, B), chunk)] + ([(cache.rows(16, 17), beside)] if beside else [])
            with num_threads(n):
                t0, w0 = time.process_time(), time.perf_counter()
                model(torch.zeros(1, B * chunk + beside, dtype=torch.long, device=cache.k.device),
                      kv_cache=Segments(parts), last_only=True)
                times[(B, chunk, beside), n].append((time.perf_counter() - w0, time.process_time() - t0))
    return [{"rows": B, "tokens": chunk, "threads": n, "wall_ms": 1000 * statistics.median(w for w, _ in xs[1:]),
             "cpu_ms": 1000 * statistics.median(c for _, c in xs[1:])} | ({"beside": beside} if beside else {})
            for ((B, chunk, beside), n), xs in times.items()]


def side(runs: list[dict], tokens: int) -> dict:
    """The medians of one side's runs at one client count."""
    med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return med | {"tokens_per_s": tokens / med["s"]}


def clients_rows(cfg, engine: BatchEngine, servers: dict[str, tuple[subprocess.Popen, str]],
                 prompt: list[int]) -> list[dict]:
    """One row per server engine and client count; the sides alternate at each count, each repeat."""
    counts = int_list(cfg.serve_clients, "serve_clients")
    runs = collections.defaultdict(list)  # (clients, side): a dict per repeat
    for _ in range(cfg.warmup + cfg.repeats):
        for c in counts:
            cpu0 = time.process_time()
            s, ttfts = in_process(engine, prompt, c, cfg.serve_max_tokens)
            runs[c, "in_process"].append({"s": s, "cpu_s": time.process_time() - cpu0} | ttft(ttfts))
            for name, (server, url) in servers.items():
                cpu0, server0 = time.process_time(), process_cpu_s(server.pid)
                s, ttfts = over_http(url, prompt, c, cfg.serve_max_tokens, cfg.serve_client)
                run = {"s": s, "client_cpu_s": time.process_time() - cpu0} | ttft(ttfts)
                if server0 is not None:
                    run["cpu_s"] = process_cpu_s(server.pid) - server0
                runs[c, name].append(run)
    rows = []
    for name in servers:
        for c in counts:
            tokens = c * cfg.serve_max_tokens
            timed = {"server": side(runs[c, name][cfg.warmup:], tokens),
                     "in_process": side(runs[c, "in_process"][cfg.warmup:], tokens)}
            row = {"engine": name, "clients": c, "tokens": tokens, **timed,
                   "time_ratio": timed["server"]["s"] / timed["in_process"]["s"]}
            if "cpu_s" in timed["server"]:
                row["cpu_ratio"] = timed["server"]["cpu_s"] / timed["in_process"]["cpu_s"]
            rows.append(row)
    for row in rows:  # against the first count's (one client's, by default) on the same engine
        first = next(r for r in rows if r["engine"] == row["engine"])
        row["vs_first"] = row["server"]["tokens_per_s"] / first["server"]["tokens_per_s"]
    return rows


def ttft(ttfts: list[float]) -> dict:
    """Times to first token at the 50th and 95th percentiles (the nearest rank), ms."""
    ranked = sorted(ttfts)
    return {f"ttft_p{q}_ms": 1000 * ranked[round(q / 100 * (len(ranked) - 1))] for q in (50, 95)}


def measure(cfg, rt: runtime.Runtime) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = serve_checkpoint(cfg, Path(tmp))
        model, _ = inference_model(model, rt, quantize=cfg.serve_quantize, batched=cfg.serve_max_batch > 1)
        prompt = [i % tok.vocab_size for i in range(1, cfg.serve_prompt_len + 1)]
        settings = EngineSettings(cfg.serve_max_batch, window_shift(None, model.config.block_size), tok.vocab_size)
        engine = BatchEngine(model, settings)
        budget = budget_rows(model, max(cfg.repeats, 3))
        engine.start()
        servers = {}
        try:
            for name in spec_list(cfg.serve_engines):
                servers[name] = start_server(cfg, rt, Path(tmp), name)
            rows = clients_rows(cfg, engine, servers, prompt)
            prefix = prefix_row(cfg, next(iter(servers.values()))[1], tok.vocab_size, model.config.block_size)
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait(60)
            engine.stop()
            engine.thread.join()
    mc = model.config
    return {"shape": cfg.serve_shape, "quantize": cfg.serve_quantize, "params": model.get_num_params(),
            "model": f"{mc.n_layer} layers x {mc.n_embd} wide, {mc.n_head} heads, block_size {mc.block_size}, "
                     f"vocab {mc.vocab_size}",
            "prompt_tokens": cfg.serve_prompt_len, "max_tokens": cfg.serve_max_tokens,
            "max_batch": cfg.serve_max_batch, "client": cfg.serve_client, "repeats": cfg.repeats, "rows": rows,
            "prefix": prefix, "budget": budget, "threads": torch.get_num_threads()}


def table(r: dict) -> str:
    rows, p = [], r["prefix"]
    for row in r["rows"]:
        sv, ip = row["server"], row["in_process"]
        rows.append([row["engine"], row["clients"], num(sv["tokens_per_s"], 1), f"{row['vs_first']:.1f}x",
                     f"{num(sv['ttft_p50_ms'])} / {num(sv['ttft_p95_ms'])}", num(ip["tokens_per_s"], 1),
                     f"{num(ip['ttft_p50_ms'])} / {num(ip['ttft_p95_ms'])}", f"{row['time_ratio']:.2f}x",
                     "n/a" if "cpu_s" not in sv else f"{num(sv['cpu_s'], 2)} / {num(ip['cpu_s'], 2)}",
                     "n/a" if "cpu_ratio" not in row else f"{row['cpu_ratio']:.2f}x", num(sv["client_cpu_s"], 2)])
    weights = "" if r.get("quantize", "none") == "none" else f", {r['quantize']} weights"
    return (f"### Serving: serve.py over HTTP against the same rows batched in-process ({r['shape']}{weights})\n"
            f"{r['model']}; {r['params'] / 1e6:.2f}M parameters; each client streams one /v1/completions request, "
            f"all at once ({r['prompt_tokens']}-token prompt, {r['max_tokens']} new tokens, sampled; {r['client']} "
            f"clients); max_batch {r['max_batch']} on both sides; medians of {r['repeats']}\n\n"
            + markdown_table(["engine", "clients", "server tok/s", f"vs {r['rows'][0]['clients']} client", "TTFT p50 / p95 ms",
                              "in-process tok/s", "in-process TTFT ms", "time ratio", "CPU s server / in-process",
                              "CPU ratio", "client CPU s"], rows)
            + f"\n\nThe prefix cache, a {p['prompt_tokens']}-token prompt sent twice (greedy, streamed; medians of "
              f"{r['repeats']}):\n\n" + markdown_table(
                ["prompt tokens", "TTFT first ms", "TTFT again ms", "first / again", "cached tokens", "same text"],
                [[p["prompt_tokens"], num(p["cold_ttft_ms"]), num(p["warm_ttft_ms"]), f"{p['speedup']:.1f}x",
                  num(p["cached_tokens"]), "yes" if p["same_text"] else "NO"]])
            + "\n\nA step's costs, what --step_tokens and --threads trade (wall / CPU ms, medians):\n\n"
            + markdown_table(["rows x tokens", "torch threads", "wall ms", "CPU ms", "CPU ms per token"],
                             [[f"{b['rows']} x {b['tokens']}" + (f" + 1 x {b['beside']}" if "beside" in b else ""),
                               b["threads"], num(b["wall_ms"], 1), num(b["cpu_ms"], 1),
                               num(b["cpu_ms"] / (b["rows"] * b["tokens"] + b.get("beside", 0)), 2)]
                              for b in r["budget"]]))
