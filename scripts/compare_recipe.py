"""The modern recipe, measured: classic GPT-2, each switch alone, and config/modern.py, trained at
equal compute on the same batches, each evaluated on the whole val split; a table and a picture.

    python scripts/compare_recipe.py config/train_shakespeare_char_cpu.py                 # every variant, then the report
    python scripts/compare_recipe.py config/train_shakespeare_char_cpu.py --variants=classic,modern --max_iters=500
    python scripts/compare_recipe.py config/train_shakespeare_char_cpu.py --phase=train --variants=rope,muon  # in parallel
    python scripts/compare_recipe.py config/train_shakespeare_char_cpu.py --phase=report  # table + PNG from what exists
    TIKTOKEN_CACHE_DIR=path/to/tiktoken_cache python scripts/compare_recipe.py config/train_shakespeare_char_cpu.py \\
        --data_dir=data/shakespeare --results_dir=recipe-bpe --variants=classic,modern   # BPE Shakespeare

Config files and --key=value set the TrainConfig every variant shares; VARIANTS change one switch each ("modern":
config/modern.py), built and stepped as train.py does on one process. Phases: "train" writes
results_dir/variants/<name>.json (one already there is skipped, so processes can split the list); "time" measures
ms/iter, the variants interleaved round by round; "report" writes table.md and val_loss.png; "all" runs the three.
"""
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository: core/, model.py and config/
sys.path.insert(0, str(ROOT))
from benchmarks.common import markdown_table, spec_list  # noqa: E402
from core import config as configlib, kernels, runtime  # noqa: E402
from core.data.loader import TokenData, TrainBatches, read_meta  # noqa: E402
from core.errors import UserError, run_cli  # noqa: E402
from core.evaluation.perplexity import evaluate_split  # noqa: E402
from core.fileio import write_json  # noqa: E402
from core.training import optim  # noqa: E402
from core.training.train_config import TrainConfig, get_lr, make_optimizer  # noqa: E402
from model import GPT, RECIPE_SWITCHES, GPTConfig  # noqa: E402

# The ReLU² recipe (LayerNorm, biases), measured best but computed by no transformers class, and the
# exportable recipes nearest to it; config/modern.py is the Qwen3 one (docs/recipe.md).
MODERN_SWITCHES = {"pos_embedding": "rope", "qk_norm": True, "mlp": "relu2", "tie_embeddings": False,
                   "optimizer": "muon", "muon_lr": 0.02}
# One switch each, against classic GPT-2; "gqa" halves the key/value heads.
VARIANTS = {
    "classic": {},
    "rope": {"pos_embedding": "rope"},
    "rmsnorm": {"norm": "rmsnorm"},
    "qk_norm": {"qk_norm": True},
    "relu2": {"mlp": "relu2"},
    "swiglu": {"mlp": "swiglu"},
    "gqa": {"n_kv_head": "half"},
    "untied": {"tie_embeddings": False},
    "softcap": {"logit_softcap": 15.0},
    "muon": {"optimizer": "muon"},
    "modern": "config/modern.py",
    "modern_relu2": dict(MODERN_SWITCHES),                                                   # exports nowhere
    "modern_nemotron": {**MODERN_SWITCHES, "qk_norm": False},                                # NemotronForCausalLM
    "modern_arcee": {**MODERN_SWITCHES, "qk_norm": False, "norm": "rmsnorm"},                # ArceeForCausalLM
}
PHASES = ("all", "train", "time", "report")


@dataclasses.dataclass
class CompareConfig:
    variants: str = "all"              # comma-separated names from VARIANTS, or all
    phase: str = "all"                 # all | train | time | report
    results_dir: str = "recipe-results"
    eval_every: int = 250              # whole-val-split evaluation every N iterations (and at the end)
    eval_batch: int = 64               # windows per evaluation forward
    timing_rounds: int = 5             # interleaved rounds; ms/iter is the median over rounds
    timing_iters: int = 10             # timed iterations per variant per round
    threads: int = 1                   # torch threads; 1 keeps a shared machine's numbers steady

    def validate(self) -> None:
        if self.phase not in PHASES:
            raise UserError(f"phase must be one of {', '.join(PHASES)}, got '{self.phase}'")
        configlib.at_least(self, 1, "eval_every", "eval_batch", "timing_rounds", "timing_iters", "threads")
        variant_names(self)


def variant_names(cmp: CompareConfig) -> list[str]:
    names = list(VARIANTS) if cmp.variants == "all" else spec_list(cmp.variants)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise UserError(f"unknown variant(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(VARIANTS)}")
    return names


def variant_config(name: str, base: TrainConfig) -> TrainConfig:
    spec = VARIANTS[name]
    overrides = configlib.read_config_file(str(ROOT / spec)) if isinstance(spec, str) else dict(spec)
    if overrides.get("n_kv_head") == "half":
        overrides["n_kv_head"] = max(1, base.n_head // 2)
    cfg = configlib.apply_overrides(base, overrides, f"variant {name}")
    cfg.validate()
    return cfg


def build(cfg: TrainConfig, rt: runtime.Runtime) -> tuple[GPT, object, TrainBatches]:
    """The variant's model (seeded as train.py seeds a new run), optimizer and training batches, on rt.device."""
    vocab = cfg.vocab_size or read_meta(cfg.data_dir)["vocab_size"]
    torch.manual_seed(cfg.seed)
    model = kernels.choose_kernels(GPT(GPTConfig(**cfg.model_args(), vocab_size=vocab)).to(rt.device))
    batches = TrainBatches(TokenData(cfg.data_dir, "train", cfg.block_size, vocab), cfg.seed, cfg.batch_size,
                           cfg.gradient_accumulation_steps, device=rt.device)
    return model, make_optimizer(model, cfg, rt.device_type), batches


def step(model: GPT, optimizer, batches: TrainBatches, cfg: TrainConfig, rt: runtime.Runtime, it: int) -> float:
    """train.py's step on one process: its learning rate, micro-steps, clipping and update."""
    optim.set_lr(optimizer, get_lr(it, cfg) / cfg.learning_rate)
    accum, loss_sum = cfg.gradient_accumulation_steps, 0.0
    for micro in range(accum):
        x, y = batches.get(it, micro)
        with rt.autocast():
            loss = model(x, y)[1] / accum
        batches.prefetch_after(it, micro)
        loss.backward()
        loss_sum += loss.detach()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item()


def train_variant(name: str, cfg: TrainConfig, cmp: CompareConfig, rt: runtime.Runtime) -> dict:
    model, optimizer, data = build(cfg, rt)
    val = TokenData(cfg.data_dir, "val", cfg.block_size)
    curve, train_s = [], 0.0
    for it in range(cfg.max_iters + 1):
        if it % cmp.eval_every == 0 or it == cfg.max_iters:
            scored = evaluate_split(model, val, batch_size=cmp.eval_batch, device=rt.device, autocast=rt.autocast)
            curve.append([it, scored.loss])
            print(f"{name}: iter {it}, val loss {curve[-1][1]:.4f} (whole split), {train_s:.0f}s training", flush=True)
        if it == cfg.max_iters:
            break
        t0 = time.perf_counter()
        loss = step(model, optimizer, data, cfg, rt, it)
        train_s += time.perf_counter() - t0
        if not math.isfinite(loss):
            raise UserError(f"variant {name}: loss is {loss} at iter {it}; lower its learning rate")
    switches = RECIPE_SWITCHES + ("optimizer", "muon_lr", "muon_momentum", "muon_weight_decay")
    overrides = {k: getattr(cfg, k) for k in switches if getattr(cfg, k) != getattr(TrainConfig(), k)}
    return {"name": name, "overrides": overrides, "params": model.get_num_params(non_embedding=False),
            "val_tokens": scored.tokens, "curve": curve, "train_s": train_s,
            "ms_per_iter_in_run": 1000 * train_s / cfg.max_iters, "config": dataclasses.asdict(cfg)}


def time_variants(names: list[str], base: TrainConfig, cmp: CompareConfig, rt: runtime.Runtime) -> dict:
    """ms per training iteration of each variant, rounds interleaved: the median over rounds of each round's mean,
    after two untimed warm-up steps. On a CPU this process's CPU time (with one thread, what an idle core would take,
    whoever shares the machine; wall time beside it); on a GPU wall time (the device does the work)."""
    runs = {}
    for name in names:
        cfg = variant_config(name, base)
        model, optimizer, data = build(cfg, rt)
        runs[name] = (cfg, model, optimizer, data)
        for it in range(2):
            step(model, optimizer, data, cfg, rt, it)
    clock = time.process_time if rt.device_type == "cpu" else time.perf_counter
    per_round, wall = {name: [] for name in names}, {name: [] for name in names}
    for r in range(cmp.timing_rounds):
        for name, (cfg, model, optimizer, data) in runs.items():
            t0, w0 = clock(), time.perf_counter()
            for i in range(cmp.timing_iters):
                step(model, optimizer, data, cfg, rt, 2 + r * cmp.timing_iters + i)
            rt.synchronize()
            per_round[name].append(1000 * (clock() - t0) / cmp.timing_iters)
            wall[name].append(1000 * (time.perf_counter() - w0) / cmp.timing_iters)
        print(f"timing round {r + 1}/{cmp.timing_rounds}: " + ", ".join(
            f"{n} {v[-1]:.0f}ms" for n, v in per_round.items()), flush=True)
    return {name: {"ms_per_iter": statistics.median(v), "rounds": v, "clock": clock.__name__,
                   "wall_ms_per_iter": statistics.median(wall[name])} for name, v in per_round.items()}


def iters_to_reach(curve: list[list[float]], target: float) -> float | None:
    """First iteration where the val loss reaches target, linear between evaluations; None if never."""
    for (i0, l0), (i1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return i1 if l0 == l1 else i0 + (i1 - i0) * (l0 - target) / (l0 - l1)
    return None


def report(results_dir: Path) -> str:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted((results_dir / "variants").glob("*.json"))}
    if not runs:
        raise UserError(f"no trained variants in {results_dir / 'variants'}; run --phase=train first")
    timing = json.loads((results_dir / "timing.json").read_text()) if (results_dir / "timing.json").exists() else {}
    order = [n for n in VARIANTS if n in runs]
    classic = runs.get("classic")
    target = classic["curve"][-1][1] if classic else None
    base_ms = timing.get("classic", {}).get("ms_per_iter")
    rows = []
    for name in order:
        r = runs[name]
        final = r["curve"][-1][1]
        ms = timing.get(name, {}).get("ms_per_iter")
        reach = iters_to_reach(r["curve"], target) if target is not None else None
        iter_ratio = reach / classic["curve"][-1][0] if reach is not None else None
        time_ratio = iter_ratio * ms / base_ms if iter_ratio is not None and ms and base_ms else None
        rows.append([name, ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "GPT-2", f"{final:.4f}",
                     f"{final - target:+.4f}" if target is not None else "",
                     f"{reach:.0f} ({iter_ratio:.2f}x)" if reach is not None else "not reached",
                     f"{ms:.1f}" if ms else "", f"{ms / base_ms:.2f}x" if ms and base_ms else "",
                     f"{time_ratio:.2f}x" if time_ratio is not None else "", f"{r['params']:,}"])
    headers = ["variant", "switches", "val loss (whole split)", "vs classic", "iters to classic's final",
               "ms/iter", "vs classic", "time to classic's final", "params"]
    text = markdown_table(headers, rows) + "\n"
    (results_dir / "table.md").write_text(text)
    plot(runs, order, target, results_dir / "val_loss.png")
    return text


def plot(runs: dict, order: list[str], target: float | None, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for name in order:
        it, loss = zip(*runs[name]["curve"])
        style = {"classic": dict(color="black", lw=2.5), "modern": dict(color="tab:red", lw=2.5)}.get(name, dict(lw=1))
        ax.plot(it, loss, label=name, **style)
    if target is not None:
        ax.axhline(target, color="black", ls=":", lw=1, label="classic's final")
    finals = [runs[n]["curve"][-1][1] for n in order]
    ax.set_ylim(min(finals) - 0.05, max(finals) + 0.6)  # the end of training, where the variants differ
    data = Path(runs[order[0]]["config"]["data_dir"]).name
    ax.set(xlabel="iteration", ylabel="val loss (whole val split)", title=f"{data}: one switch at a time vs GPT-2")
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):  # this script's own keys, then the training config's
        print("\n".join(["this script's own keys:", *configlib.config_help(CompareConfig).splitlines()[1:],
                         "the training config every variant shares (config files and --key=value, as train.py):",
                         *configlib.config_help(TrainConfig).splitlines()[1:]]))
        sys.exit(0)
    own = {f"--{f.name}" for f in dataclasses.fields(CompareConfig)}  # the rest: the training config's files and keys
    mine = [a for a in argv if a.partition("=")[0] in own]
    cmp = configlib.parse_args(CompareConfig, mine)
    base = configlib.parse_args(TrainConfig, [a for a in argv if a not in mine])
    results_dir = Path(cmp.results_dir)
    (results_dir / "variants").mkdir(parents=True, exist_ok=True)
    names = variant_names(cmp)
    rt = runtime.setup(base.device, base.dtype, base.dist_timeout_s, cmp.threads)
    try:
        if rt.dtype == "float16":  # its step has no loss scaling (train.py's GradScaler)
            raise UserError("compare_recipe trains in float32 or bfloat16; pass --dtype=float32 or --dtype=bfloat16")
        if cmp.phase in ("all", "train"):
            for name in names:
                path = results_dir / "variants" / f"{name}.json"
                if path.exists():
                    print(f"{name}: already in {path}, skipped")
                    continue
                write_json(path, train_variant(name, variant_config(name, base), cmp, rt))
        if cmp.phase in ("all", "time"):
            write_json(results_dir / "timing.json", time_variants(names, base, cmp, rt)
                       | {"machine": {"load_average_1min": os.getloadavg()[0], "threads": cmp.threads,
                                      "torch": torch.__version__}})
        if cmp.phase in ("all", "report"):
            print(report(results_dir))
    finally:
        runtime.teardown(rt)


if __name__ == "__main__":
    run_cli(main)
