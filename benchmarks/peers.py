"""Peers: one exported model decoded by ours, CTranslate2 and llama.cpp, tokens/s side by side.

One model at GPT-2 small's shape (random weights: speed does not depend on them; tests/test_peers.py
checks the engines' greedy text agrees on trained ones) with GPT-2's 50,257 ids (CTranslate2's GPT-2
converter takes no padded rows), exported with export.py. Each engine decodes peers_new_tokens greedy
tokens after the same peers_prompt_len-token prompt:
- ours: inference_model with --quantize none, int8, int4 (core/decoding/quantize.py), generate_stream;
  16 streams are one generate() call over 16 rows (the batch the server's BatchEngine steps);
- CTranslate2: its TransformersConverter at float32 and int8 (it has no int4 on a CPU), generate_batch;
  at batch 1 a 1-token run's time is taken off (the prefill); 16 streams are one call, prefill counted;
- llama.cpp: node-llama-cpp's prebuilt CPU build (tools/llama-cpp/run.mjs), F32 and Q8_0 GGUFs from
  export.py --format=gguf (Q4_0: neither the converter nor node-llama-cpp quantizes to it); 16 streams
  are 16 sequences of one context, which llama.cpp decodes in one batch.
Batch-1 rates count the tokens after the first over the time from the first to the last (the prefill
apart); 16-stream rates are every stream's tokens together. Each row is measured at one thread and at
peers_threads_all (0: every core the OS reports). The bound column is benchmarks/bandwidth.py's: every
weight byte one step reads at that precision (the Blocks' matrices and the head at 4, 1 or 0.5 bytes,
their scales left out; the rest float32), at the copy's bandwidth. A peer not installed is one line.

    python bench.py --sections=peers
    python bench.py --sections=peers --peers_engines=ours,ctranslate2 --peers_new_tokens=50
"""
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import bandwidth, decode
from benchmarks.common import ROOT, gpt_config, markdown_table, num, num_threads, some_of, spec_list
from core import runtime
from core.config import at_least
from core.data.tokenizer import GPT2Tokenizer
from core.decoding.decode import inference_model
from core.errors import UserError
from core.weights import gguf
from core.weights.hf_export import export
from model import GPT, GPTConfig

RUN_MJS = ROOT / "tools" / "llama-cpp" / "run.mjs"
ENGINES = ("ours", "ctranslate2", "llama.cpp")
# (engine, weights label, what the engine is given, bytes per matrix weight for the bound)
ROWS = [("ours", "float32", "none", 4), ("ours", "int8", "int8", 1), ("ours", "int4", "int4", 0.5),
        ("ctranslate2", "float32", None, 4), ("ctranslate2", "int8", "int8", 1), ("ctranslate2", "int4", "n/a", 0.5),
        ("llama.cpp", "F32 GGUF", "f32", 4), ("llama.cpp", "Q8_0 GGUF", "q8_0", 1), ("llama.cpp", "Q4_0 GGUF", "n/a", 0.5)]


@dataclasses.dataclass
class Settings:
    peers_n_layer: int = 12      # GPT-2 small's shape, 124M parameters
    peers_n_head: int = 12
    peers_n_embd: int = 768
    peers_block_size: int = 1024
    peers_prompt_len: int = 14
    peers_new_tokens: int = 200
    peers_streams: int = 16      # concurrent streams where the engine batches
    peers_threads_all: int = 0   # the "all threads" column; 0: os.cpu_count()
    peers_engines: str = ",".join(ENGINES)


IN_DEFAULT_RUN = False  # minutes at GPT-2 small's shape: only when --sections names it


def check(cfg) -> None:
    at_least(cfg, 1, "peers_n_layer", "peers_n_head", "peers_prompt_len", "peers_streams")
    at_least(cfg, 2, "peers_new_tokens")  # a rate needs a token after the first
    at_least(cfg, 0, "peers_threads_all")
    some_of(cfg.peers_engines, ENGINES, "peers_engines")
    if cfg.peers_prompt_len + cfg.peers_new_tokens > cfg.peers_block_size:
        raise UserError(f"peers_prompt_len + peers_new_tokens ({cfg.peers_prompt_len + cfg.peers_new_tokens}) "
                        f"exceed peers_block_size {cfg.peers_block_size}")
    model_config(cfg)


def preflight(cfg) -> None:
    GPT2Tokenizer()  # the export writes GPT-2's BPE: fail now if its file cannot be loaded


def model_config(cfg) -> GPTConfig:
    return gpt_config(cfg, "peers_", vocab_size=50257, bias=True)


def missing(engine: str) -> str | None:
    """Why a peer cannot run here, in one line; None when it can."""
    if engine == "ctranslate2":
        return None if importlib.util.find_spec("ctranslate2") else "not installed (pip install ctranslate2)"
    if engine == "llama.cpp":
        if shutil.which("node") is None:
            return "node is not on PATH (node-llama-cpp needs Node.js)"
        if not (RUN_MJS.parent / "node_modules" / "node-llama-cpp").is_dir():
            return "node-llama-cpp is not installed: bash scripts/fetch_llama_cpp.sh"
        if not (gguf.converter_dir() / "convert_hf_to_gguf.py").is_file():
            return "llama.cpp's converter is not fetched: bash scripts/fetch_llama_converter.sh"
    return None


def ours_rate(m: GPT, prompt: list[int], cfg, threads: int, streams: int, rt: runtime.Runtime) -> float:
    """Tokens per second after the first token: every stream's, over the first token to the last."""
    idx = torch.tensor([prompt] * streams, device=rt.device)
    with num_threads(threads), torch.no_grad():
        times = decode.token_times(m, idx, cfg.peers_new_tokens, use_cache=True, shift=1, rt=rt)  # greedy
    return streams * (len(times) - 1) / sum(times[1:])


def ctranslate2_rate(folder: Path, prompt: list[int], cfg, threads: int, streams: int) -> float:
    import ctranslate2

    vocab = json.loads((folder / "vocabulary.json").read_text())
    gen = ctranslate2.Generator(str(folder), device="cpu", intra_threads=threads)
    tokens = [vocab[i] for i in prompt]

    def seconds(n: int) -> float:
        t0 = time.perf_counter()
        gen.generate_batch([tokens] * streams, max_length=n, min_length=n, sampling_topk=1,
                           include_prompt_in_result=False)
        return time.perf_counter() - t0
    n = cfg.peers_new_tokens
    if streams == 1:  # the prefill and first token apart, as for the others: a 1-token run's time taken off
        return (n - 1) / (seconds(n) - seconds(1))
    return streams * n / seconds(n)


def llama_cpp_rate(gguf: Path, prompt: list[int], cfg, threads: int, streams: int) -> float:
    result = subprocess.run(["node", str(RUN_MJS), f"--model={gguf}", f"--prompt={','.join(map(str, prompt))}",
                             f"--tokens={cfg.peers_new_tokens}", f"--threads={threads}", f"--parallel={streams}"],
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise UserError(f"llama.cpp (tools/llama-cpp/run.mjs) failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_s"]


def prepare(engine: str, given: str, model: GPT, rt, hf_dir: Path, tmp: Path):
    """The engine's own form of the model: ours quantized (a copy: quantize replaces its Linears), a
    CTranslate2 folder, a GGUF file."""
    if engine == "ours":  # float32 weights, as the peers are given; int8 and int4 quantize from them
        return inference_model(copy.deepcopy(model), dataclasses.replace(rt, dtype="float32"), quantize=given)[0]
    if engine == "ctranslate2":
        import ctranslate2

        out = tmp / f"ct2-{given or 'float32'}"
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out), quantization=given, force=True)
        return out
    out = tmp / f"model-{given}.gguf"
    result = subprocess.run([sys.executable, str(ROOT / "export.py"), "--format=gguf", f"--hf_dir={hf_dir}",
                             f"--gguf={out}", f"--outtype={given}"], capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise UserError(f"export.py --format=gguf --outtype={given} failed: {result.stderr.strip().splitlines()[-1:]}")
    return out


def bound_tokens_per_s(model: GPT, matrix_bytes: float, context: int, bw: float) -> float:
    """benchmarks/bandwidth.py's bound at batch 1: the step's weight bytes with the Blocks' matrices and the
    head at matrix_bytes each, the float32 KV cache at `context`."""
    matrices = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    weights = bandwidth.decode_weight_bytes(model) - 4 * matrices + matrix_bytes * matrices
    return 1 / bandwidth.bound_s(int(weights), bandwidth.kv_cache_bytes(model.config, context, 4), bw)


def measure(cfg, rt: runtime.Runtime) -> dict:
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg)).eval()
    prompt = torch.randint(model.config.vocab_size, (cfg.peers_prompt_len,),
                           generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    threads = [1, cfg.peers_threads_all or os.cpu_count() or 1]
    bw = bandwidth.copy_bandwidth()
    context = cfg.peers_prompt_len + cfg.peers_new_tokens // 2  # the mean context of the run
    engines = spec_list(cfg.peers_engines)
    absent = {e: why for e in engines if (why := missing(e))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        export(model, GPT2Tokenizer(), hf_dir, check=False)
        for engine, weights, given, matrix_bytes in ROWS:
            if engine not in engines or engine in absent:
                continue
            row = {"engine": engine, "weights": weights,
                   "bound": bound_tokens_per_s(model, matrix_bytes, context, bw), "rates": None}
            if given != "n/a":
                where = prepare(engine, given, model, rt, hf_dir, Path(tmp))
                rate_of = {"ours": functools.partial(ours_rate, rt=rt), "ctranslate2": ctranslate2_rate,
                           "llama.cpp": llama_cpp_rate}[engine]
                row["rates"] = [rate_of(where, prompt, cfg, t, 1) for t in threads] + [
                    rate_of(where, prompt, cfg, threads[-1], cfg.peers_streams)]
            rows.append(row)
            print(f"  {engine} {weights}: {row['rates']}", flush=True)
    return {"rows": rows, "absent": absent, "threads": threads, "streams": cfg.peers_streams,
            "bandwidth": bw, "new_tokens": cfg.peers_new_tokens, "prompt_len": cfg.peers_prompt_len,
            "shape": f"{cfg.peers_n_layer} x {cfg.peers_n_embd}, {model.get_num_params() / 1e6:.0f}M"}


def table(r: dict) -> str:
    one, many = r["threads"]
    header = ["engine", "weights", "1 thread, tok/s", f"{many} threads, tok/s",
              f"{r['streams']} streams, {many} threads, tok/s", "bound, tok/s"]
    rows = [[row["engine"], row["weights"],
             *(["n/a"] * 3 if row["rates"] is None else [num(x, 1) for x in row["rates"]]), num(row["bound"], 1)]
            for row in r["rows"]]
    lines = [f"{r['shape']}: {r['new_tokens']} greedy tokens after a {r['prompt_len']}-token prompt; bound at "
             f"{r['bandwidth'] / 1e9:.1f} GB/s (benchmarks/bandwidth.py)", "", markdown_table(header, rows)]
    lines += [f"{engine}: {why}" for engine, why in r["absent"].items()]
    return "\n".join(lines)
