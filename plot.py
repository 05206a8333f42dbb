"""Pictures of runs and models: loss curves from out_dir/log.jsonl, and attention maps.

    python plot.py out-shakespeare-char-cpu                      # -> out-shakespeare-char-cpu/loss.png
    python plot.py out-a out-b --out=compare.png                 # runs overlaid, labelled by what differs
    python plot.py out-a out-b --x=tokens                        # against tokens seen (runs of different batch)
    python plot.py out-a --x=elapsed                             # against wall time (log.jsonl's elapsed_s)
    python plot.py speedrun/1337/nanogpt speedrun/1337/ours --x=seconds --target=1.88   # bench.py's speedrun logs
    python plot.py out-rl-tasks-char                             # an rl.py run -> out-rl-tasks-char/rewards.png
    python plot.py attention --out_dir=out-shakespeare-char-cpu --prompt="ROMEO: But soft" --layer=1
    python plot.py attention --init_from=gpt2 --prompt="The cat sat on the mat because it" --summary=entropy

What each picture shows, and how a log still being written or resumed is read: docs/evaluation.md. An
rl.py run (its records hold a reward) is drawn as rewards and each task's held-out exact match instead.
"""
from core.errors import UserError, quiet_start, run_cli
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import dataclasses
import functools
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from core.config import config_help, parse_args

# --x: the eval records' key of each time axis (bench.py --sections=speedrun --speedrun_log_dir writes both)
TIMES = {"seconds": "train_s", "cpu_seconds": "train_cpu_s"}
XLABELS = {"iter": "iteration", "tokens": "tokens seen", "elapsed": "seconds since the run started (wall clock)",
           "seconds": "training seconds (evaluation excluded)",
           "cpu_seconds": "training CPU seconds of the process (evaluation excluded)"}  # --x's values
# Keys that say where or how a run was logged, not what was trained: never a label.
UNLABELLED = {"out_dir", "wandb_log", "wandb_project", "wandb_run_name", "log_interval", "eval_only",
              "always_save_checkpoint", "checkpoint_interval", "dist_timeout_s", "hellaswag_file"}


@dataclasses.dataclass
class LossPlotConfig:
    out: str | None = None   # the PNG; None: loss.png in the first out_dir
    x: str = "iter"          # iter: iterations below, tokens seen on top; tokens: tokens seen below; elapsed: wall
                             # seconds of the run, evals and saves included (every record's elapsed_s);
                             # seconds / cpu_seconds: training wall / CPU seconds (bench.py's speedrun logs them)
    target: float | None = None  # a val loss to mark with a horizontal line
    title: str | None = None
    ymax: float | None = None  # clip the loss axis (the first iterations' loss can dwarf the rest)

    def validate(self) -> None:
        if self.x not in XLABELS:
            raise UserError(f"x must be 'iter', 'tokens', 'elapsed', 'seconds' or 'cpu_seconds', got '{self.x}'")


@dataclasses.dataclass
class AttentionConfig:
    init_from: str = "resume"    # 'resume' (out_dir/ckpt.pt), a GPT-2 name, or a save_pretrained directory
    out_dir: str = "out"
    prompt: str = "\n"           # or FILE:path
    layer: int = 0               # the layer drawn head by head (0 is the first; -1 the last)
    summary: str = "distance"    # distance | entropy, per layer and head
    out: str | None = None       # None: attention.png in out_dir (resume) or here (GPT-2)
    max_tokens: int = 48         # longer prompts make unreadable panels

    def validate(self) -> None:
        if self.summary not in ("distance", "entropy"):
            raise UserError(f"summary must be 'distance' or 'entropy', got '{self.summary}'")


@dataclasses.dataclass
class RunHistory:
    """One run's log.jsonl read back (core.training.runlog.RunLog writes it)."""
    out_dir: Path
    config: dict
    steps: dict[int, dict]   # iter -> {"loss", "lr", ...}, one per logged iteration
    evals: dict[int, dict]   # iter -> {"train_loss", "val_loss", "lr", ...}

    @property
    def tokens_per_iter(self) -> int | None:
        c = self.config
        keys = ("batch_size", "block_size", "gradient_accumulation_steps")
        return math.prod(c[k] for k in keys) if all(isinstance(c.get(k), int) for k in keys) else None

    def tokens_seen(self, it: int) -> int:
        """Tokens trained in the iterations before `it`: it x tokens_per_iter, except that under
        sequence-length warm-up the first windows are shorter (core.training.train_config.seq_len_at)."""
        prefix = self._warmup_prefix if self.config.get("seq_len_warmup_iters") else [0]
        warm = len(prefix) - 1
        return prefix[min(it, warm)] + max(it - warm, 0) * self.tokens_per_iter

    @functools.cached_property
    def _warmup_prefix(self) -> list[int]:
        """[tokens before iteration i for i in 0..seq_len_warmup_iters]"""
        from core.training.train_config import TrainConfig, seq_len_at  # imports torch: only for warm-up runs
        c = self.config
        cfg = TrainConfig(block_size=c["block_size"], seq_len_warmup_iters=c["seq_len_warmup_iters"],
                          seq_len_warmup_start=c["seq_len_warmup_start"])
        rows = self.tokens_per_iter // cfg.block_size
        return [0, *itertools.accumulate(rows * seq_len_at(i, cfg) for i in range(cfg.seq_len_warmup_iters))]


def read_log(out_dir: str | Path) -> RunHistory:
    """A run's log.jsonl and config.json. A last line cut short (a run writing or killed) is skipped;
    a bad line before it is an error naming it."""
    out_dir = Path(out_dir)
    path = out_dir / "log.jsonl"
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is not a folder; pass the out_dir of a training run")
    if not path.is_file():
        raise UserError(f"{out_dir} has no log.jsonl; is it a training run's out_dir? (train.py writes it there)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    steps, evals = {}, {}
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            it = record["iter"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if number == len(lines):
                continue  # cut short while being written
            raise UserError(f"{path} line {number} is not a log record: {line[:60]!r}") from None
        evaluated = "val_loss" in record or any(k.startswith("heldout_") for k in record)  # train.py's, rl.py's
        (evals if evaluated else steps)[it] = record  # a later record of an iteration wins
    if not steps and not evals:
        raise UserError(f"{path} has no logged iterations yet; wait for the first log_interval or eval")
    config_path = out_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        print(f"note: {config_path} is missing or unreadable; {out_dir.name} is drawn without tokens seen",
              file=sys.stderr)
        config = {}
    return RunHistory(out_dir, config, dict(sorted(steps.items())), dict(sorted(evals.items())))


def run_labels(runs: list[RunHistory]) -> list[str]:
    """Each run's folder name and, with several runs, the config values that differ between them."""
    if len(runs) == 1:
        c, tpi = runs[0].config, runs[0].tokens_per_iter
        has_shape = all(k in c for k in ("n_layer", "n_head", "n_embd"))
        shape = f"{c['n_layer']}L {c['n_head']}H {c['n_embd']}d" if has_shape else ""
        details = [", ".join(s for s in (shape, f"{tpi:,} tok/iter" if tpi else "") if s)]
    else:
        keys = sorted({k for r in runs for k in r.config} - UNLABELLED)
        differ = [k for k in keys if len({json.dumps(r.config.get(k)) for r in runs}) > 1]
        if "init_from" in differ and any(r.config.get("init_from") == "resume" for r in runs):
            differ.remove("init_from")  # a resumed run rewrites config.json with init_from=resume
        details = [", ".join(f"{k}={r.config.get(k)}" for k in differ[:4]) for r in runs]
    names = [r.out_dir.resolve().name for r in runs]
    return [f"{name} ({detail})" if detail else name for name, detail in zip(names, details)]


def plot_losses(runs: list[RunHistory], x: str = "iter", title: str | None = None, ymax: float | None = None,
                target: float | None = None):
    """The figure: loss (top), HellaSwag acc_norm if a run logged it (train.py --hellaswag_file), and the
    learning rate (bottom) of every run, against iterations, tokens, or training seconds (x="seconds" or
    "cpu_seconds": evaluations only, at each one's train_s or train_cpu_s)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    hellaswag = any("hellaswag_acc_norm" in r for run in runs for r in run.evals.values())
    ratios = [3, 1.2, 1] if hellaswag else [3, 1]
    fig, axes = pyplot().subplots(len(ratios), 1, sharex=True, figsize=(9, 6.5 + 2 * hellaswag),
                                  height_ratios=ratios, layout="constrained")
    ax, ax_lr = axes[0], axes[-1]
    tpis = [r.tokens_per_iter for r in runs]
    if x == "tokens" and None in tpis:
        raise UserError(f"--x=tokens needs batch_size, block_size and gradient_accumulation_steps in each run's "
                        f"config.json; {runs[tpis.index(None)].out_dir} has none")
    key = TIMES.get(x)
    untimed = [r.out_dir for r in runs if key and not (r.evals and all(key in e for e in r.evals.values()))]
    if untimed:
        raise UserError(f"--x={x} needs {key} in every eval record (bench.py --sections=speedrun "
                        f"--speedrun_log_dir writes it); {untimed[0]} has none")
    unstamped = [r.out_dir for r in runs if x == "elapsed" and any("elapsed_s" not in rec for rec in
                                                                   [*r.steps.values(), *r.evals.values()])]
    if unstamped:
        raise UserError(f"--x=elapsed needs elapsed_s in every log record (train.py writes it); {unstamped[0]}'s "
                        f"log.jsonl was written without it: plot it with --x=iter")
    for i, (run, label) in enumerate(zip(runs, run_labels(runs))):
        color = f"C{i}"
        at = run.tokens_seen if x == "tokens" else (lambda s: s)  # the x of iteration s
        if x == "elapsed" or key:  # each record at its time: wall time since the start, or training time so far
            stamp = key or "elapsed_s"  # (steps carry no training time)
            run = dataclasses.replace(run, steps={} if key else {s[stamp]: s for s in run.steps.values()},
                                      evals={e[stamp]: e for e in run.evals.values()})
        steps, evals = run.steps, run.evals
        if steps:
            ax.plot(*series(steps, "loss", at), color=color, lw=0.8, alpha=0.35)
        # val loss, drawn when empty too: the run keeps its legend entry
        ax.plot(*series(evals, "val_loss", at), color=color, lw=1.8, marker="o", ms=3, label=label)
        ax.plot(*series(evals, "train_loss", at), color=color, lw=1.2, ls="--")
        if hellaswag:
            axes[1].plot(*series(evals, "hellaswag_acc_norm", at), color=color, lw=1.5, marker="o", ms=3)
        ax_lr.plot(*series(steps or evals, "lr", at), color=color, lw=1.2)
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    if target is not None:
        ax.axhline(target, color="black", ls=":", lw=1)
        ax.annotate(f"target {target:.4f}", (1, target), xycoords=("axes fraction", "data"), ha="right",
                    va="bottom", fontsize=8)
    if ymax is not None:
        ax.set_ylim(top=ymax)
    # One legend: the runs by colour, then what each line style means.
    handles, labels = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="gray", lw=1.8, marker="o", ms=3), Line2D([], [], color="gray", lw=1.2, ls="--"),
                Line2D([], [], color="gray", lw=0.8, alpha=0.5)]
    labels += ["val loss (eval)", "train loss (eval)", "train loss (each logged step)"]
    ax.legend(handles, labels, loc="upper right", fontsize=8)
    if hellaswag:
        axes[1].set_ylabel("HellaSwag acc_norm")
        axes[1].axhline(0.25, color="gray", lw=0.8, ls=":")  # chance: 4 endings
    if x == "tokens":
        ax_lr.xaxis.set_major_formatter(EngFormatter())
    elif x == "iter" and any(r.config.get("seq_len_warmup_iters") for r in runs):
        print("note: sequence-length warm-up makes the first iterations shorter; the top axis of tokens seen is "
              "left out (--x=tokens plots against them)", file=sys.stderr)
    elif x == "iter" and len(set(tpis)) == 1 and tpis[0]:
        tpi = tpis[0]
        top = ax.secondary_xaxis("top", functions=(lambda it: it * tpi, lambda tok: tok / tpi))
        top.set_xlabel(f"tokens seen ({tpi:,} per iteration)")
        top.xaxis.set_major_formatter(EngFormatter())
    elif x == "iter":
        print("note: the runs see different numbers of tokens per iteration; the top axis is left out "
              "(--x=tokens plots against tokens seen)", file=sys.stderr)
    return finish(fig, axes, XLABELS[x], title)


def plot_rewards(runs: list[RunHistory], title: str | None = None):
    """rl.py's runs: reward (top: each logged iteration faint, the mean of the last 10 solid) with each task's held-out
    exact match at the evals (dashed, one marker per task), the mean reply length, and the learning rate."""
    from matplotlib.lines import Line2D

    fig, axes = pyplot().subplots(3, 1, sharex=True, figsize=(9, 7), height_ratios=[3, 1, 1], layout="constrained")
    ax, ax_len, ax_lr = axes
    tasks = sorted({k.removeprefix("heldout_") for run in runs for e in run.evals.values() for k in e
                    if k.startswith("heldout_")})
    markers = dict(zip(tasks, "osD^v<>"))
    for i, (run, label) in enumerate(zip(runs, run_labels(runs))):
        color, its = f"C{i}", list(run.steps)
        rewards = [run.steps[s]["reward"] for s in its]
        ax.plot(its, rewards, color=color, lw=0.8, alpha=0.3)
        window = [sum(rewards[max(0, j - 9):j + 1]) / len(rewards[max(0, j - 9):j + 1]) for j in range(len(rewards))]
        ax.plot(its, window, color=color, lw=1.8, label=label)
        for task in tasks:
            ax.plot(*series(run.evals, f"heldout_{task}"), color=color, lw=1.2, ls="--", marker=markers[task], ms=4)
        ax_len.plot(its, [run.steps[s]["reply_tokens"] for s in its], color=color, lw=1.2)
        ax_lr.plot(its, [run.steps[s]["lr"] for s in its], color=color, lw=1.2)
    ax.set(ylabel="reward; held-out exact match", ylim=(-0.02, 1.02))
    handles, labels = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="gray", lw=0.8, alpha=0.4)]
    labels += ["mean reward of the iteration's replies (solid: over the last 10)"]
    handles += [Line2D([], [], color="gray", lw=1.2, ls="--", marker=markers[t], ms=4) for t in tasks]
    labels += [f"held-out exact match, {t} (eval, greedy)" for t in tasks]
    ax.legend(handles, labels, loc="lower right", fontsize=8)
    ax_len.set_ylabel("reply tokens")
    return finish(fig, axes, "iteration", title)


def series(records: dict[int, dict], key: str, at=lambda s: s) -> tuple[list, list]:
    """(x, value) of each record that holds key: x is at(the record's iteration or time)."""
    kept = [s for s in records if key in records[s]]
    return [at(s) for s in kept], [records[s][key] for s in kept]


def finish(fig, axes, xlabel: str, title: str | None):
    """What both pictures end with: every panel gridded, the learning rate at the bottom against xlabel."""
    for a in axes:
        a.grid(alpha=0.3)
    axes[-1].set(xlabel=xlabel, ylabel="learning rate")
    axes[-1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    if title:
        fig.suptitle(title)
    return fig


def loss_main(argv: Sequence[str]) -> Path:
    dirs = [a for a in argv if not a.startswith("-")]
    cfg = parse_args(LossPlotConfig, [a for a in argv if a.startswith("-")])
    if not dirs:
        raise UserError("pass one or more out_dirs: python plot.py out-a [out-b ...] [--out=loss.png]")
    runs = [read_log(d) for d in dirs]
    rl = [any("reward" in r for r in run.steps.values()) for run in runs]
    if any(rl) and not all(rl):
        raise UserError(f"{runs[rl.index(True)].out_dir} is an rl.py run and {runs[rl.index(False)].out_dir} is "
                        f"not; plot rewards and losses separately")
    if all(rl) and cfg.x != "iter":
        raise UserError(f"rl.py runs are drawn against iterations; drop --x={cfg.x}")
    fig = plot_rewards(runs, cfg.title) if all(rl) else plot_losses(runs, cfg.x, cfg.title, cfg.ymax, cfg.target)
    out = Path(cfg.out) if cfg.out else Path(dirs[0]) / ("rewards.png" if all(rl) else "loss.png")
    save(fig, out)
    return out


def pyplot():
    """matplotlib.pyplot on its file backend (no display), imported only when a picture is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, out: Path) -> None:
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        pyplot().close(fig)
    print(f"wrote {out}")


def attention_maps(model, ids: list[int]):
    """Attention weights (n_layer, n_head, T, T) of the prompt `ids`, from a naive-backend copy of model."""
    import torch
    from model import GPT

    naive = GPT(dataclasses.replace(model.config, attn_backend="naive", dropout=0.0))
    naive.load_state_dict(model.state_dict())
    with torch.no_grad():
        _, _, att = naive.eval()(torch.tensor([ids]), return_attn=True)  # (L, 1, nh, T, T)
    return att[:, 0]


def mean_distance(att):
    """(..., T, T) -> (...): how far back, in tokens, a query's attention reaches on average,
    averaged over queries 1..T-1 (query 0 can only attend to itself)."""
    import torch

    pos = torch.arange(att.size(-1), dtype=att.dtype)
    return (att * (pos[:, None] - pos)).sum(-1)[..., 1:].mean(-1)  # i - j; keys after the query have weight 0


def entropy(att):
    """(..., T, T) -> (...): entropy of each query's attention in nats, averaged over queries 1..T-1;
    0 is one key, log(i + 1) is uniform over all i + 1 visible keys."""
    return -att.xlogy(att).sum(-1)[..., 1:].mean(-1)  # xlogy: 0 log 0 is 0


def token_labels(tok, ids: list[int]) -> list[str]:
    """Each token's own text, whitespace made visible."""
    return [tok.decode([i]).replace(" ", "\u2423").replace("\n", "\\n").replace("\t", "\\t") or "\u2205" for i in ids]


def plot_heads(att_layer, labels: list[str], title: str):
    """One panel per head: att_layer (nh, T, T), query tokens down, key tokens across."""
    import numpy as np

    nh, T = att_layer.shape[0], att_layer.shape[-1]
    cols = math.ceil(math.sqrt(nh))  # 4 heads: 2 x 2; 12: 4 x 3
    rows = math.ceil(nh / cols)
    side = max(3.0, 0.2 * T + 1.2)  # inches per panel: room for T tick labels
    fig, axes = pyplot().subplots(rows, cols, figsize=(side * cols + 1, side * rows + 0.6), squeeze=False,
                                  layout="constrained")
    upper = np.triu(np.ones((T, T), dtype=bool), k=1)  # keys after the query: never attended
    fontsize = 8 if T <= 32 else 6
    for h, ax in enumerate(axes.flat):
        if h >= nh:
            ax.axis("off")
            continue
        image = ax.imshow(np.ma.masked_array(att_layer[h].numpy(), upper), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {h}", fontsize=10)
        ax.set_xticks(range(T), labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(T), labels, fontsize=fontsize)
        ax.set_xlabel("key (attended to)", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title)
    return fig


def plot_summary(values, kind: str, title: str):
    """Heatmap of (n_layer, n_head) values, each cell written in."""
    L, nh = values.shape
    fig, ax = pyplot().subplots(figsize=(max(4.5, 0.7 * nh + 2.5), max(3.0, 0.45 * L + 1.8)), layout="constrained")
    image = ax.imshow(values.numpy(), cmap="magma", aspect="auto")
    for layer, h in itertools.product(range(L), range(nh)):
        v = float(values[layer, h])
        bright = v > float(values.min()) + 0.6 * float(values.max() - values.min())
        ax.text(h, layer, f"{v:.1f}" if kind == "distance" else f"{v:.2f}", ha="center", va="center", fontsize=7,
                color="black" if bright else "white")
    ax.set(xticks=range(nh), yticks=range(L), xlabel="head", ylabel="layer")
    what = "mean attention distance (tokens)" if kind == "distance" else "attention entropy (nats)"
    fig.colorbar(image, ax=ax, label=what)
    ax.set_title(title, fontsize=10)
    return fig


def attention_main(argv: Sequence[str]) -> tuple[Path, Path]:
    from core.weights.resolver import kind_of, load_model  # torch is imported only here: loss plots start without it
    from core.data.tokenizer import encode_prompt, read_prompt

    cfg = parse_args(AttentionConfig, argv)
    model, tok, source = load_model(cfg.init_from, cfg.out_dir)
    L = model.config.n_layer
    if not -L <= cfg.layer < L:
        raise UserError(f"layer {cfg.layer} does not exist: the model has {L} layers (0 to {L - 1}, "
                        f"or -1 for the last)")
    ids = encode_prompt(tok, read_prompt(cfg.prompt), model.config.block_size)
    if not 2 <= len(ids) <= cfg.max_tokens:
        raise UserError(f"the prompt is {len(ids)} tokens; draw 2 to {cfg.max_tokens} (--max_tokens=N raises the "
                        f"limit, at the cost of smaller labels)")
    att = attention_maps(model, ids)  # (L, nh, T, T)
    layer, labels = cfg.layer % L, token_labels(tok, ids)
    here = Path(cfg.out_dir) if kind_of(cfg.init_from) == "resume" else Path()
    out = Path(cfg.out) if cfg.out else here / "attention.png"
    save(plot_heads(att[layer], labels, f"{source}: attention of layer {layer} ({len(ids)} tokens)"), out)
    values = mean_distance(att) if cfg.summary == "distance" else entropy(att)
    summary_out = out.with_name(out.stem + "_summary.png")
    save(plot_summary(values, cfg.summary, f"{source}, {len(ids)}-token prompt"), summary_out)
    return out, summary_out


USAGE = """usage: python plot.py OUT_DIR [OUT_DIR ...] [--key=value ...]   loss curves of one or more runs
                                                                (rl.py's runs: rewards and held-out exact match)
       python plot.py attention [--key=value ...]              attention maps (python plot.py attention --help)
loss curves' """


def main(argv: Sequence[str]):
    if argv and argv[0] == "attention":
        return attention_main(argv[1:])
    if any(a in ("-h", "--help") for a in argv):  # the subcommand and the out_dirs, which parse_args cannot list
        print(USAGE + config_help(LossPlotConfig))
        sys.exit(0)
    return loss_main(argv)


if __name__ == "__main__":
    run_cli(main)
