"""Proof of where RL wins: more SFT, rejection-sampling fine-tuning and REINFORCE from one SFT checkpoint, at equal
compute, three seeds, on tasks whose harder problems have a checker and no demonstrations (docs/chat.md: the
setting, the tables and pass@k against k).

    python scripts/rl_proof.py                          # needs the base run: the README's CPU quick start
    python scripts/rl_proof.py --seeds=1337 --rl_args=--max_iters=50 --problems=50 --sampled=20

Runs from the repo root, one command at a time on one thread, reusing an out-sft-checked-char checkpoint as the
SFT every arm starts from; more SFT gets the larger RL run's forward and backward tokens. Every number goes to
rl_proof.json, which a rerun reuses (--fresh starts over).
"""
import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repo's core/ importable
from core.config import read_config_file  # noqa: E402

BASE = "out-shakespeare-char-cpu"
DATA = "data/chat_checked"
SFT = ["config/train_shakespeare_char_cpu.py", "config/sft_tasks_char.py", f"--data_dir={DATA}"]
SFT_TOKENS = 2 * 12 * 64  # an SFT iteration's forward and backward tokens (the quick start's batch)
TASKS = ("sort", "palindrome")
SPLITS = ("heldout", "longer")
SAMPLES = 64
RL_CONFIG = "config/rl_checked_char.py"
ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run(cmd: list[str]) -> None:
    """Run `python cmd...` to completion with one thread."""
    result = subprocess.run([sys.executable, *cmd, *(["--threads=1"] if cmd[0] in ("train.py", "rl.py") else [])],
                            capture_output=True, text=True, env=ENV)
    if result.returncode:
        sys.exit(f"failed: python {shlex.join(cmd)}\n{result.stderr[-2000:]}")


def rl_tokens(out_dir: str) -> float:
    """The forward and backward tokens of an rl.py run: the sum of its iterations' (logged at every iteration)."""
    records = [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]
    return sum(r["tokens"] for r in records if "tokens" in r)


def scores(out_dir: str, problems: int, sampled: int) -> dict:
    """{task: {split: {"greedy": pass@1, "pass@k": {k: ...}}, "demos_heldout": {"greedy": ...}}} of one model."""
    import torch

    from core.data import tasks as tasklib
    from core.data.chat import ChatTemplate
    from core.evaluation.answers import task_scores
    from core.weights import resolver

    torch.set_num_threads(1)
    model, tok, _ = resolver.load_model(out_dir, out_dir)
    template, out = ChatTemplate.for_tokenizer(tok), {}
    for task in TASKS:
        out[task] = {}
        for split in (*SPLITS, "demos_heldout"):
            chosen = tasklib.problems(task, split, problems)
            out[task][split] = {"greedy": task_scores(model.eval(), template, task, chosen)["mean"]}
            if split != "demos_heldout":
                passed = task_scores(model, template, task, chosen[:sampled], SAMPLES, 1.0)["pass@k"]
                out[task][split]["pass@k"] = {str(k): v for k, v in passed.items()}  # as JSON keeps them
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1337,1338,1339", help="comma-separated: one run of each arm each")
    parser.add_argument("--rl_args", default="", help="extra rl.py arguments (both RL arms), e.g. --max_iters=100")
    parser.add_argument("--problems", type=int, default=200, help="problems per task and split, scored greedily")
    parser.add_argument("--sampled", type=int, default=40, help="the first of those also scored at pass@k")
    parser.add_argument("--results", default="rl_proof.json", help="every number, read back by a rerun")
    parser.add_argument("--fresh", action="store_true", help="retrain and rescore everything")
    parser.add_argument("--plot", default="rl_passk.png", help="the PNG of pass@k against k")
    args = parser.parse_args(argv)
    path = Path(args.results)
    results = {} if args.fresh or not path.exists() else json.loads(path.read_text())

    def stage(name: str, cmd: list[str], out_dir: str) -> None:  # a run, unless this file records it finished
        if name not in results.get("runs", {}):
            if name != "SFT" or not (Path(out_dir) / "ckpt.pt").exists():
                run(cmd)
            results.setdefault("runs", {})[name] = {"out_dir": out_dir}
            path.write_text(json.dumps(results, indent=1))

    if not (Path(DATA) / "train.bin").exists():
        run(["data/chat/tasks.py", "--tasks=" + ",".join(TASKS), "--n_train=20000", f"--out_dir={DATA}"])
        run(["data/chat/prepare.py", f"--input={DATA}/tasks_train.jsonl", f"--tokenizer_from={BASE}",
             "--block_size=64", f"--out_dir={DATA}"])
    stage("SFT", ["train.py", *SFT, "--out_dir=out-sft-checked-char", "--max_iters=3000", "--lr_decay_iters=3000",
                  "--eval_interval=500", "--overwrite=True"], "out-sft-checked-char")
    rl_config = read_config_file(RL_CONFIG)  # more SFT steps at the RL arms' rates: the arms differ in their update
    rates = [f"--learning_rate={rl_config['learning_rate']}", f"--min_lr={rl_config['min_lr']}", "--warmup_iters=0"]
    for seed in args.seeds.split(","):
        rl = ["rl.py", RL_CONFIG, f"--seed={seed}", "--overwrite=True", *shlex.split(args.rl_args)]
        stage(f"REINFORCE {seed}", [*rl, f"--out_dir=out-rl-reinforce-s{seed}"], f"out-rl-reinforce-s{seed}")
        stage(f"RFT {seed}", [*rl, "--update=rft", f"--out_dir=out-rl-rft-s{seed}"], f"out-rl-rft-s{seed}")
        budget = max(rl_tokens(f"out-rl-{arm}-s{seed}") for arm in ("reinforce", "rft"))
        n = round(budget / SFT_TOKENS)
        stage(f"more SFT {seed}", ["train.py", *SFT, "--init_from=out-sft-checked-char", f"--seed={seed}",
                                   f"--out_dir=out-sft-more-s{seed}", f"--max_iters={n}", f"--lr_decay_iters={n}",
                                   f"--eval_interval={n}", "--overwrite=True", *rates], f"out-sft-more-s{seed}")
    for name, r in results["runs"].items():
        r["tokens"] = rl_tokens(r["out_dir"]) if name.startswith(("RFT", "REINFORCE")) else \
            SFT_TOKENS * (json.loads((Path(r["out_dir"]) / "config.json").read_text())["max_iters"])
        if r.get("problems") != [args.problems, args.sampled]:
            r["scores"] = scores(r["out_dir"], args.problems, args.sampled)
            r["problems"] = [args.problems, args.sampled]
            path.write_text(json.dumps(results, indent=1))
    print(tables(results))
    plot_passk(results, Path(args.plot))
    print(f"wrote {args.plot}")


def tables(results: dict) -> str:
    """One markdown table per task: each run's compute and its scores, the SFT it started from first."""
    out = []
    for task in TASKS:
        out += [f"**{task}**", "", "| arm | seed | fwd+bwd tokens | " + " | ".join(
            f"{split} {m}" for split in SPLITS for m in ("pass@1 (greedy)", "pass@8", "pass@64"))
            + " | demos_heldout (greedy) |", "|---|---|---|" + "---|" * (3 * len(SPLITS) + 1)]
        for name, r in results["runs"].items():
            arm, _, seed = name.rpartition(" ") if name != "SFT" else ("SFT (the start)", "", "-")
            s = r["scores"][task]
            cells = [c for split in SPLITS for c in (f"{s[split]['greedy']:.1%}", f"{s[split]['pass@k']['8']:.1%}",
                                                     f"{s[split]['pass@k']['64']:.1%}")]
            out.append(f"| {arm} | {seed} | {r['tokens'] / 1e6:.2f}M | " + " | ".join(cells)
                       + f" | {s['demos_heldout']['greedy']:.1%} |")
        out.append("")
    return "\n".join(out)


def plot_passk(results: dict, path: Path):
    """A panel per task (rows) and split (columns), pass@k against k, a color per arm (runs named "ARM SEED"),
    each seed faint and the mean over seeds solid; written to path, and returned."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    arms: dict[str, list[dict]] = {}
    for name, run in results["runs"].items():
        arms.setdefault(name.rpartition(" ")[0] or name, []).append(run["scores"])
    fig, axes = plt.subplots(len(TASKS), len(SPLITS), squeeze=False, sharex=True, sharey=True,
                             figsize=(4.5 * len(SPLITS), 3.2 * len(TASKS)), layout="constrained")
    for (i, task), (j, split) in itertools.product(enumerate(TASKS), enumerate(SPLITS)):
        ax = axes[i][j]
        for c, (arm, runs) in enumerate(arms.items()):
            curves = [run[task][split]["pass@k"] for run in runs]
            ks = [int(k) for k in curves[0]]
            for curve in curves:
                ax.plot(ks, list(curve.values()), color=f"C{c}", lw=0.8, alpha=0.3)
            ax.plot(ks, [sum(v) / len(v) for v in zip(*(c.values() for c in curves))], color=f"C{c}", lw=1.8,
                    marker="o", ms=3, label=f"{arm} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{task}, {split}", fontsize=10)
        ax.set_xlabel("k (replies per problem)" if i == len(TASKS) - 1 else "")
        ax.set_ylabel("pass@k" if j == 0 else "")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.savefig(path, dpi=110)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])
