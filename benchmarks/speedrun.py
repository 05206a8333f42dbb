"""Speedrun: training time to a target val loss (the whole val split, core.evaluation.perplexity.evaluate_split).

nanoGPT's model and plain loop (benchmarks/nanogpt.py) against ours (speedrun_base + speedrun_ours), taking turns
of speedrun_chunk iterations, scored coarse then fine near the target; only iterations are timed, on the wall and
CPU clocks. The race's rules (the sides, the target, the crossing, the time): docs/speedrun.md, "How the race is run".
"""
import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks import nanogpt
from benchmarks.common import int_list, markdown_table, model_text, num, read_recipe, spec_list
from core import kernels, runtime
from core.config import at_least
from core.data.loader import TokenData, read_meta
from core.errors import UserError
from core.evaluation.perplexity import evaluate_split
from core.fileio import write_json
from core.training.train_config import TrainConfig, get_lr, make_optimizer, seq_len_at
from model import GPT, GPTConfig


@dataclasses.dataclass
class Settings:
    speedrun_base: str = "config/train_shakespeare_char_cpu.py"  # nanoGPT's run; ours starts from it too
    # ours: config files and key=value pairs, comma-separated, after the base: the modern recipe, then the
    # race's own settings (config/speedrun_char.py: its schedule, learning rate, value embeddings, MLP width)
    speedrun_ours: str = "config/modern.py,config/speedrun_char.py"
    speedrun_shape: str = ""   # key=value pairs applied to every run last (the gpt2 preset: GPT-2 small's shape)
    speedrun_runs: str = "nanogpt,ours"  # which runs race; ratios are to the first
    speedrun_seeds: str = "1337"         # one race per seed, each run seeded alike (weights and batches)
    target: float | None = None          # val loss to reach; None: SPEEDRUN_TARGETS, or measured first
    speedrun_target_iters: int = 2000    # the default target is nanoGPT's val loss after this many iterations
    speedrun_measure_target: bool = False  # measure the default target now, even where one is recorded
    speedrun_eval_every: int = 100       # whole-val-split evaluation every N iterations ...
    speedrun_eval_fine: int = 20         # ... and every M once within speedrun_eval_margin of the target
    speedrun_eval_margin: float = 0.03
    speedrun_eval_batch: int = 64        # windows of block_size per evaluation forward
    speedrun_chunk: int = 50             # iterations per turn; the runs take turns until each is done
    speedrun_max_iters_factor: float = 1.5  # a run stops unreached after this times its config's max_iters
    speedrun_data_dir: str = ""          # a prepared dataset; "": quick-start characters built from the corpus
    speedrun_log_dir: str = ""           # also write <dir>/<seed>/<run>/log.jsonl + config.json (plot.py reads them)


IN_DEFAULT_RUN = False  # it trains for minutes: only when --sections names it
# the speedrun at GPT-2 small's shape on the character data (its target is measured first: none recorded)
PRESETS = {"gpt2": dict(speedrun_shape="n_layer=12,n_head=12,n_embd=768,block_size=1024,batch_size=16,"
                                       "learning_rate=6e-4,min_lr=6e-5")}
# The default target: the val loss (whole split) that nanoGPT's plain loop reaches at speedrun_target_iters with
# the default speedrun_base and no speedrun_shape, seed 1337, on the prepared quick-start data. Measured once with
#     python bench.py --sections=speedrun --speedrun_measure_target=True --speedrun_seeds=1337
SPEEDRUN_TARGETS = {("config/train_shakespeare_char_cpu.py", "", 2000): 1.8883}
SPEEDRUN_RUNS = ("nanogpt", "ours")
CLOCKS = (time.perf_counter, time.process_time)  # wall, and this process's CPU time: a test scripts them


@dataclasses.dataclass
class Racer:
    """One run of the race: step(it) trains iteration it, evaluate() gives the whole-val-split loss, tokens_at(it)
    iteration it's tokens, sync() waits for the device, log(record) keeps an evaluation; the rest is its record."""
    name: str
    step: Callable[[int], object]
    evaluate: Callable[[], float]
    max_iters: int  # the cap: a run that has not reached the target by then stops without it
    tokens_at: Callable[[int], int]
    sync: Callable[[], None] = lambda: None
    log: Callable[[dict], None] = lambda record: None
    it: int = 0  # iterations trained
    tokens: int = 0  # tokens trained, the sum of tokens_at over them
    train_wall_s: float = 0.0
    train_cpu_s: float = 0.0
    eval_wall_s: float = 0.0
    curve: list = dataclasses.field(default_factory=list)  # [iter, val loss, train wall s, train CPU s]
    reached: dict | None = None
    turns: int = 0

    @property
    def done(self) -> bool:  # a turn that reaches the cap scores it before it ends
        return self.reached is not None or self.it >= self.max_iters


def eval_due(it: int, curve: list, target: float, every: int, fine_every: int, margin: float) -> bool:
    """Evaluate every `every`-th iteration, and every `fine_every`-th near the target: the last evaluation within
    `margin`, or the line through the last two reaching it before the next coarse one (from the second evaluation)."""
    if it % every == 0:
        return True
    if not curve or it % fine_every:
        return False
    (i1, l1) = curve[-1][:2]
    if l1 <= target + margin:
        return True
    if len(curve) < 2 or curve[-2][0] == 0:  # the untrained model's loss is far off the curve's line
        return False
    (i0, l0) = curve[-2][:2]
    slope = (l1 - l0) / (i1 - i0)  # loss per iteration, negative while it falls
    return slope < 0 and i1 + (target - l1) / slope < i1 + every


def take_turn(r: Racer, n: int, target: float, every: int, fine_every: int, margin: float, clocks=CLOCKS) -> None:
    """Up to n iterations of r, scored where due and at the cap. A stretch of iterations is closed with sync()
    before the clocks are read; a score's own time goes to eval_wall_s."""
    wall, cpu = clocks
    w0, c0 = wall(), cpu()
    for trained in range(n + 1):
        if (not r.curve or r.curve[-1][0] != r.it) and (
                r.it == r.max_iters or eval_due(r.it, r.curve, target, every, fine_every, margin)):
            r.sync()
            w = wall()
            r.train_wall_s += w - w0
            r.train_cpu_s += cpu() - c0
            loss = r.evaluate()
            w0, c0 = wall(), cpu()
            r.eval_wall_s += w0 - w
            r.curve.append([r.it, loss, r.train_wall_s, r.train_cpu_s])
            r.log({"iter": r.it, "val_loss": loss, "train_s": r.train_wall_s, "train_cpu_s": r.train_cpu_s})
            if loss <= target:
                r.reached = {"iter": r.it, "tokens": r.tokens, "wall_s": r.train_wall_s,
                             "cpu_s": r.train_cpu_s, "val_loss": loss}
        if r.done:
            return  # just scored: no stretch open
        if trained == n:
            break
        r.step(r.it)
        r.tokens += r.tokens_at(r.it)
        r.it += 1
    r.sync()
    r.train_wall_s += wall() - w0
    r.train_cpu_s += cpu() - c0


def race(racers: list[Racer], chunk: int, target: float, every: int, fine_every: int, margin: float,
         clocks=CLOCKS, label: str = "") -> None:
    """Turns of `chunk` iterations, each run in order, until every one is done: whatever else loads the
    machine meanwhile hits all of them alike."""
    while not all(r.done for r in racers):
        for r in racers:
            if not r.done:
                take_turn(r, chunk, target, every, fine_every, margin, clocks)
                r.turns += 1
                print(f"{label}{r.name}: iter {r.it}, val loss {r.curve[-1][1]:.4f}, {r.train_wall_s:.0f} s training",
                      flush=True)


def check(cfg) -> None:
    at_least(cfg, 1, "speedrun_target_iters", "speedrun_eval_every", "speedrun_eval_fine", "speedrun_eval_batch",
             "speedrun_chunk")
    int_list(cfg.speedrun_seeds, "speedrun_seeds")
    runs = spec_list(cfg.speedrun_runs)
    if not runs or set(runs) - set(SPEEDRUN_RUNS) or len(set(runs)) != len(runs):
        raise UserError(f"speedrun_runs must list some of {','.join(SPEEDRUN_RUNS)} once each, got "
                        f"'{cfg.speedrun_runs}'")
    if not cfg.speedrun_max_iters_factor >= 1 or cfg.speedrun_eval_margin < 0:
        raise UserError(f"need speedrun_max_iters_factor >= 1 and speedrun_eval_margin >= 0, got "
                        f"{cfg.speedrun_max_iters_factor}, {cfg.speedrun_eval_margin}")


def tokens_per_iter(cfg: TrainConfig, it: int | None = None) -> int:
    """The tokens iteration it trains (None: any after a sequence-length warm-up)."""
    seq_len = cfg.block_size if it is None else seq_len_at(it, cfg)
    return cfg.batch_size * seq_len * cfg.gradient_accumulation_steps


def build_racer(name: str, recipe: TrainConfig, seed: int, data_dir: str, vocab: int, cap: int, cfg,
                rt: runtime.Runtime, log_dir: Path | None) -> Racer:
    """Run `name` (SPEEDRUN_RUNS) of recipe, stepped as nanoGPT's loop steps, its weights and its batches' own
    generator seeded with `seed`."""
    if name == "nanogpt" and rt.device_type == "cpu":
        rt = dataclasses.replace(rt, dtype="float32")  # nanoGPT's train.py uses no autocast on a CPU
    torch.manual_seed(seed)
    model = kernels.choose_kernels(GPT(GPTConfig(**(recipe.model_args() | {"vocab_size": vocab}))).to(rt.device).train())
    optimizer = (nanogpt.adamw if name == "nanogpt" else make_optimizer)(model, recipe, rt.device_type)
    gen = torch.Generator().manual_seed(seed)
    train_path = Path(data_dir) / "train.bin"
    step = nanogpt.train_step(model, optimizer, lambda it: nanogpt.get_batch(
        train_path, recipe.block_size, recipe.batch_size, rt.device, gen, seq_len_at(it, recipe)), recipe, rt)
    val = TokenData(data_dir, "val", recipe.block_size)

    def evaluate() -> float:
        return evaluate_split(model, val, batch_size=cfg.speedrun_eval_batch, device=rt.device,
                              autocast=rt.autocast).loss
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        write_json(log_dir / "config.json", dataclasses.asdict(recipe) | {"seed": seed, "run": name})
        (log_dir / "log.jsonl").write_text("")

    def log(record: dict) -> None:
        if log_dir is not None:
            with open(log_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record | {"lr": get_lr(record["iter"], recipe)}) + "\n")
    return Racer(name, step, evaluate, cap, lambda it: tokens_per_iter(recipe, it), rt.synchronize, log)


def speedrun_target(cfg, base: TrainConfig, data_dir: str, vocab: int, rt: runtime.Runtime) -> tuple[float, str]:
    """The target val loss and where it came from: --target, the recorded one, or measured now (nanoGPT's
    loop for speedrun_target_iters at the first seed, evaluated once at the end)."""
    if cfg.target is not None:
        return cfg.target, "--target"
    recorded = SPEEDRUN_TARGETS.get((cfg.speedrun_base, cfg.speedrun_shape, cfg.speedrun_target_iters))
    if recorded is not None and not cfg.speedrun_measure_target and not cfg.speedrun_data_dir:
        return recorded, f"recorded: nanoGPT's loop at {cfg.speedrun_target_iters} iterations, seed 1337"
    n, seed = cfg.speedrun_target_iters, int_list(cfg.speedrun_seeds, "speedrun_seeds")[0]
    r = build_racer("nanogpt", base, seed, data_dir, vocab, n, cfg, rt, None)
    take_turn(r, n, -math.inf, n, n, 0.0)  # scored at the start and at n, its cap
    return r.curve[-1][1], f"measured now: nanoGPT's loop at {n} iterations, seed {seed}"


def measure(cfg, rt: runtime.Runtime) -> dict:
    if rt.distributed:
        raise UserError("the speedrun section runs on one process; start bench.py without torchrun")
    shape, runs = spec_list(cfg.speedrun_shape), spec_list(cfg.speedrun_runs)
    base = read_recipe([cfg.speedrun_base, *shape], "--speedrun_base")
    recipes = {"nanogpt": base, "ours": read_recipe([cfg.speedrun_base, *spec_list(cfg.speedrun_ours), *shape],
                                                    "--speedrun_ours")}
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.speedrun_data_dir:
            data_dir = source = cfg.speedrun_data_dir
            vocab = read_meta(data_dir)["vocab_size"]
        else:  # the quick start's characters
            data_dir, (source, vocab) = tmp, nanogpt.char_dataset(Path(tmp))
            source += ", characters, 90/10 split"
        target, target_source = speedrun_target(cfg, base, data_dir, vocab, rt)
        print(f"speedrun target: val loss {target:.4f} ({target_source})", flush=True)
        seeds = []
        for seed in int_list(cfg.speedrun_seeds, "speedrun_seeds"):
            log_root = Path(cfg.speedrun_log_dir) / str(seed) if cfg.speedrun_log_dir else None
            racers = [build_racer(name, recipes[name], seed, data_dir, vocab,
                                  math.ceil(cfg.speedrun_max_iters_factor * recipes[name].max_iters), cfg, rt,
                                  log_root / name if log_root else None) for name in runs]
            race(racers, cfg.speedrun_chunk, target, cfg.speedrun_eval_every, cfg.speedrun_eval_fine,
                 cfg.speedrun_eval_margin, label=f"seed {seed} ")
            seeds.append({"seed": seed, "runs": {r.name: {"reached": r.reached, "iters_run": r.it,
                                                          "train_wall_s": r.train_wall_s, "train_cpu_s": r.train_cpu_s,
                                                          "eval_wall_s": r.eval_wall_s, "curve": r.curve,
                                                          "alternated_chunks": r.turns} for r in racers}})
    return {"target": target, "target_source": target_source, "data": source, "runs": runs,
            "recipes": {name: f"{cfg.speedrun_base}" + "".join(f" + {s}" for s in spec_list(cfg.speedrun_ours))
                        if name == "ours" else cfg.speedrun_base for name in runs},
            "shape": cfg.speedrun_shape, "models": {name: model_text(GPTConfig(**(recipes[name].model_args() | {
                "vocab_size": vocab})), recipes[name].batch_size) for name in runs},
            "tokens_per_iter": {name: tokens_per_iter(recipes[name]) for name in runs},
            "eval": {"every": cfg.speedrun_eval_every, "fine_every": cfg.speedrun_eval_fine,
                     "margin": cfg.speedrun_eval_margin}, "chunk": cfg.speedrun_chunk, "seeds": seeds,
            "summary": summary(seeds, runs)}


def summary(seeds: list[dict], runs: list[str]) -> dict:
    """Per run: the mean over seeds of what it took to reach the target (None where a seed did not), and
    each run's ratio to the first run's on each clock."""
    out = {}
    for name in runs:
        got = [s["runs"][name]["reached"] for s in seeds]
        out[name] = None if None in got else {k: statistics.mean(g[k] for g in got)
                                              for k in ("iter", "tokens", "wall_s", "cpu_s")}
    first = out[runs[0]]
    for name in runs[1:]:
        if out[name] and first:
            out[name] |= {f"{ratio}_ratio": out[name][key] / first[key]
                          for ratio, key in (("wall", "wall_s"), ("cpu", "cpu_s"), ("iter", "iter"))}
    return out


def table(r: dict) -> str:
    runs, first = r["runs"], r["runs"][0]
    reached = [(s["seed"], {name: run["reached"] for name, run in s["runs"].items()}) for s in r["seeds"]]
    rows = []
    for seed, got in reached + [("mean", r["summary"])]:  # each run's figures at the target, by run name
        for name in runs:
            g, base = got[name], got[first]
            if g is None:
                rows.append([seed, name, "not reached", "-", "-", "-", "-", "-"])
                continue
            rows.append([seed, name, num(g["iter"]), num(g["tokens"]), num(g["wall_s"], 1), num(g["cpu_s"], 1),
                         *(f"{g[k] / base[k]:.2f}x" if base else "-" for k in ("wall_s", "cpu_s"))])
    models = "\n".join(f"{name}: {r['recipes'][name]}; {r['models'][name]}, {r['tokens_per_iter'][name]:,} tokens "
                       f"per iteration" for name in runs)
    e = r["eval"]
    return (f"### Speedrun: training time to val loss {r['target']:.4f} on the whole val split\n"
            f"target: {r['target_source']}; data: {r['data']}\n{models}\n"
            f"evaluated every {e['every']} iterations, every {e['fine_every']} within {e['margin']} of the target; "
            f"the runs take turns of {r['chunk']} iterations; times count training only (evaluation apart)\n\n"
            + markdown_table(["seed", "run", "iters to target", "tokens", "train wall s", "train CPU s",
                              f"wall vs {first}", f"CPU vs {first}"], rows))
