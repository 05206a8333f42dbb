"""Performance, measured side by side in one run: training, decoding, attention memory, serving, data preparation.

    python bench.py                                    # CPU sizes: ~7.5 minutes on 2 idle cores (docs/performance.md)
    python bench.py --compile=False --repeats=5        # skip torch.compile; more timed repeats
    python bench.py --threads=1                        # one thread (the default 0: torch's, one per core); see THREADS
    python bench.py --sections=attention,decode        # some of SECTIONS (speedrun and peers run only when named)
    python bench.py --sections=memory                  # ddp vs fsdp state per process; activation checkpointing
    python bench.py --sections=serve                   # serve.py streaming to 1, 4, 16, 64 clients vs in-process
    python bench.py --sections=speedrun --speedrun_seeds=1337,1338   # time to a val loss: nanoGPT vs ours (docs/speedrun.md)
    python bench.py --sections=peers                   # ours, CTranslate2, llama.cpp: tokens/s per precision (docs/performance.md)
    python bench.py --preset=gpt2 --device=cuda --dtype=bfloat16     # GPT-2 small; attention up to T = 16384
    TIKTOKEN_CACHE_DIR=path/to/tiktoken_cache python bench.py   # offline: GPT-2's BPE file for the prepare section
    python bench.py --batch_size=8 --block_size=1024 --n_embd=768 --n_head=12 --n_layer=12 --vocab_size=50304 \\
        --device=cuda --dtype=bfloat16                 # the same training model, flag by flag

Each section is a module of benchmarks/ (its docstring says how it measures): Settings (its flags), check(cfg),
measure(cfg, rt), table(result); a new one is that file and a line in SECTIONS. Ratios compare figures of one run.
Tables go to stdout in Markdown and, with the machine, to --out (JSON) after each section; out of memory is "OOM".
"""
from core.errors import quiet_start
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import contextlib
import dataclasses
import datetime
import os
import platform
import time
from pathlib import Path
from typing import Sequence

import torch

from benchmarks import attention, decode, loop, memory, peers, prepare, serve, speedrun, train
from benchmarks.common import merged_config, merged_presets, num_threads, some_of, spec_list
from core import runtime
from core.config import apply_overrides, at_least, parse_args
from core.errors import UserError, run_cli
from core.fileio import write_json

SECTIONS = {"train": train, "loop": loop, "attention": attention, "decode": decode, "prepare": prepare,  # in run order
            "memory": memory, "serve": serve, "speedrun": speedrun, "peers": peers}


@dataclasses.dataclass
class General:
    preset: str = "cpu"        # "cpu": the defaults; "gpt2": GPT-2 small sizes for a GPU (PRESETS)
    device: str = "auto"
    dtype: str = "auto"
    # THREADS: 0 is torch's default, one per core. On a shared machine two OpenMP threads spin-wait for each
    # other whenever another process holds a core, which makes the figures slower and erratic: --threads=1.
    threads: int = 0
    seed: int = 1337
    sections: str = ",".join(name for name, m in SECTIONS.items() if getattr(m, "IN_DEFAULT_RUN", True))
    out: str = "bench.json"
    warmup: int = 1            # untimed runs before each timed figure
    repeats: int = 3           # timed runs; each figure is their median


BenchConfig = merged_config("BenchConfig", General, SECTIONS, __name__)
PRESETS = merged_presets({"cpu": {}, "gpt2": dict(warmup=3, repeats=10, threads=0)}, SECTIONS)


def load_config(argv: Sequence[str]):
    """Defaults, then the preset, then config files and --key=value: what you pass beats the preset."""
    preset = parse_args(BenchConfig, argv).preset  # parse_args checks every key and type
    if preset not in PRESETS:
        raise UserError(f"unknown preset '{preset}'; use one of {', '.join(PRESETS)}")
    cfg = parse_args(BenchConfig, argv, base=apply_overrides(BenchConfig(), PRESETS[preset], f"preset {preset}"))
    some_of(cfg.sections, SECTIONS, "--sections")
    at_least(cfg, 0, "warmup", "threads")
    at_least(cfg, 1, "repeats")
    for module in SECTIONS.values():
        getattr(module, "check", lambda cfg: None)(cfg)
    return cfg


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(rt: runtime.Runtime) -> dict:
    cpu = cpu_model()
    return {
        "cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": runtime.native_bf16(rt.device),
        "device": rt.device, "device_name": torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else cpu,
        "dtype": rt.dtype, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # thread settings change CPU results a lot on a shared machine (THREADS)
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY",
                                            "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CPP_MARCH") if k in os.environ},
    }


def main(argv: Sequence[str]) -> dict:
    """Measure the chosen sections in SECTIONS' order, printing each table as it is done."""
    start = time.perf_counter()
    cfg = load_config(argv)
    rt = runtime.setup(cfg.device, cfg.dtype)
    chosen = {name: module for name, module in SECTIONS.items() if name in spec_list(cfg.sections)}  # in run order
    for module in chosen.values():  # fail now, not after minutes of measuring (prepare: GPT-2's BPE file)
        getattr(module, "preflight", lambda cfg: None)(cfg)
    with num_threads(cfg.threads or torch.get_num_threads()):  # called in-process (tests), the count comes back
        result = {"machine": machine_info(rt), "config": dataclasses.asdict(cfg)}
        m = result["machine"]
        print(f"## bench.py on {m['device_name']} ({m['cpu_cores']} cores, {m['torch_threads']} torch threads), "
              f"torch {m['torch']}, {rt.device} {rt.dtype}, {m['date']}")
        for name, module in chosen.items():
            t0 = time.perf_counter()
            result[name] = module.measure(cfg, rt)
            result[name]["section_s"] = time.perf_counter() - t0
            print(f"\n{module.table(result[name])}\n\n({result[name]['section_s']:.0f} s)", flush=True)
            write_json(cfg.out, result)  # what is measured is kept, whatever happens in the next section
    result["wall_s"] = time.perf_counter() - start
    result["machine"]["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    write_json(cfg.out, result)
    print(f"\n{result['wall_s']:.0f} s in all; wrote {cfg.out}")
    return result


if __name__ == "__main__":
    run_cli(main)
