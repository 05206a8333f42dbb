"""bench.py's speedrun section: the crossing, the alternation, evaluation time kept apart, the recipes it
reads; then a tiny race end to end and its logs drawn by plot.py. Speed itself is never asserted.

    python -m pytest tests/test_speedrun.py
"""
import json

import pytest

import bench
import plot
from benchmarks import common, speedrun
from core.errors import UserError
from core.training import loop, optim
from tests.helpers import REPO_ROOT, cli_args, make_char_dataset, one_thread

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60


class Clock:
    """A scripted pair of clocks: wall and CPU seconds move only when told."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def tick(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu

    @property
    def clocks(self):
        return (lambda: self.wall), (lambda: self.cpu)


def scripted(name, clock, losses, trace, max_iters=1000, step_s=(1.0, 0.5), eval_s=100.0):
    """A Racer whose step costs step_s (wall, CPU), whose evaluation costs eval_s of wall time, and whose
    val loss at iteration it is losses(it); every step, sync and evaluation is appended to trace."""
    def step(it):
        trace.append((name, "step", it))
        clock.tick(*step_s)

    def evaluate():
        trace.append((name, "eval", r.it))
        clock.tick(eval_s, 0.0)
        return losses(r.it)
    r = speedrun.Racer(name, step, evaluate, max_iters, tokens_at=lambda it: 768,
                       sync=lambda: trace.append((name, "sync", r.it)))
    return r


def test_eval_due_is_coarse_far_from_the_target_and_fine_near_it():
    assert speedrun.eval_due(0, [], 2.0, 100, 20, 0.05)  # the start is always scored
    assert not speedrun.eval_due(40, [[0, 2.5]], 2.0, 100, 20, 0.05)  # far: only every 100
    assert speedrun.eval_due(40, [[0, 2.04]], 2.0, 100, 20, 0.05)  # within the margin: every 20
    assert not speedrun.eval_due(50, [[0, 2.04]], 2.0, 100, 20, 0.05)
    # 2.3 -> 2.1 over 100 iterations: the line reaches 2.0 at 250, before the next coarse evaluation at 300
    assert speedrun.eval_due(220, [[100, 2.3], [200, 2.1]], 2.0, 100, 20, 0.05)
    assert not speedrun.eval_due(220, [[100, 2.5], [200, 2.4]], 2.0, 100, 20, 0.05)  # the line reaches it at 600
    assert not speedrun.eval_due(220, [[100, 2.3], [200, 2.4]], 2.0, 100, 20, 0.05)  # rising: no crossing ahead
    assert not speedrun.eval_due(120, [[0, 4.2], [100, 2.3]], 2.0, 100, 20, 0.05)  # not from the untrained start


def test_crossing_is_the_first_evaluation_at_or_below_the_target_and_evaluation_time_is_excluded():
    clock, trace = Clock(), []
    r = scripted("a", clock, lambda it: 5.0 - 0.01 * it, trace)  # 4.05 at iteration 95
    speedrun.race([r], chunk=1000, target=4.05, every=50, fine_every=5, margin=0.5, clocks=clock.clocks)
    evals = [it for _, kind, it in trace if kind == "eval"]
    # coarse until iteration 50 came within the margin (4.5 <= 4.55), then every 5 until the crossing
    assert evals == [0, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95]
    assert all(trace[i - 1][1] == "sync" for i, t in enumerate(trace) if t[1] == "eval")  # the device is waited for
    assert r.reached == {"iter": 95, "tokens": 95 * 768, "wall_s": 95.0, "cpu_s": 47.5, "val_loss": pytest.approx(4.05)}
    assert r.it == 95 and r.done  # no step after the crossing
    assert r.eval_wall_s == 100.0 * len(evals)  # every evaluation's time, and none of it in wall_s
    assert [c[0] for c in r.curve] == evals and r.curve[-1][2:] == [95.0, 47.5]


def test_runs_take_turns_in_chunks_and_the_faster_one_stops_first():
    clock, trace = Clock(), []
    fast = scripted("fast", clock, lambda it: 3.0 if it < 6 else 1.0, trace)
    slow = scripted("slow", clock, lambda it: 3.0 if it < 10 else 1.0, trace)
    speedrun.race([fast, slow], chunk=3, target=2.0, every=2, fine_every=2, margin=0.0, clocks=clock.clocks)
    steps = [(name, it) for name, kind, it in trace if kind == "step"]
    assert steps == ([("fast", i) for i in range(3)] + [("slow", i) for i in range(3)]
                     + [("fast", i) for i in range(3, 6)] + [("slow", i) for i in range(3, 6)]
                     + [("slow", i) for i in range(6, 10)])  # fast crossed at 6: slow goes on alone
    assert fast.reached["iter"] == 6 and slow.reached["iter"] == 10
    assert trace[[t[0] for t in trace].index("slow") - 1] == ("fast", "sync", 3)  # a turn ends synced
    assert (fast.turns, slow.turns) == (2, 4)
    # each run's time is its own: the other's steps and everyone's evaluations are not in it
    assert (fast.reached["wall_s"], slow.reached["wall_s"]) == (6.0, 10.0)


def test_a_run_that_never_gets_there_stops_at_its_cap_unreached():
    clock, trace = Clock(), []
    r = scripted("a", clock, lambda it: 3.0, trace, max_iters=7)
    speedrun.race([r], chunk=5, target=2.0, every=5, fine_every=5, margin=0.0, clocks=clock.clocks)
    assert r.reached is None and r.done and r.it == 7
    assert [c[0] for c in r.curve] == [0, 5, 7]  # the cap is always scored
    assert r.train_wall_s == 7.0


def test_summary_means_over_seeds_and_ratios_to_the_first_run():
    reached = lambda it, w, c: {"reached": {"iter": it, "tokens": it * 10, "wall_s": w, "cpu_s": c}}  # noqa: E731
    seeds = [{"seed": 1, "runs": {"nanogpt": reached(100, 10.0, 8.0), "ours": reached(20, 3.0, 2.0)}},
             {"seed": 2, "runs": {"nanogpt": reached(120, 14.0, 12.0), "ours": reached(30, 3.0, 3.0)}}]
    s = speedrun.summary(seeds, ["nanogpt", "ours"])
    assert s["nanogpt"] == {"iter": 110, "tokens": 1100, "wall_s": 12.0, "cpu_s": 10.0}
    assert s["ours"]["wall_ratio"] == pytest.approx(0.25) and s["ours"]["cpu_ratio"] == pytest.approx(0.25)
    assert s["ours"]["iter_ratio"] == pytest.approx(25 / 110)
    seeds[1]["runs"]["ours"] = {"reached": None}
    assert speedrun.summary(seeds, ["nanogpt", "ours"])["ours"] is None  # a missed seed is no mean


def test_recipe_reads_config_files_then_key_values_as_train_py_does():
    r = common.read_recipe(["config/train_shakespeare_char_cpu.py", "config/modern.py", "lr_schedule=wsd",
                           "n_layer=2"], "--speedrun_ours")
    assert (r.batch_size, r.block_size, r.optimizer, r.lr_schedule) == (12, 64, "muon", "wsd")
    assert r.model_args()["n_layer"] == 2 and r.model_args()["pos_embedding"] == "rope"
    assert speedrun.tokens_per_iter(r) == 768
    with pytest.raises(UserError, match="--speedrun_ours: unknown config key 'n_layr'"):
        common.read_recipe(["n_layr=2"], "--speedrun_ours")

def test_the_race_trains_what_its_config_file_says(monkeypatch, tmp_path):
    """The speedrun's recipe is config/speedrun_char.py, the file a user runs with train.py: the default
    speedrun_ours names it and reads to the same TrainConfig as docs/speedrun.md's command; and an edit to
    the file is what the race then trains (a copy of the settings kept in benchmarks/speedrun.py would not be)."""
    import shutil

    import train

    settings = speedrun.Settings()
    specs = [settings.speedrun_base, *common.spec_list(settings.speedrun_ours)]
    raced = common.read_recipe(specs, "--speedrun_ours")
    assert raced == loop.parse_config(train.TrainConfig, ["config/train_shakespeare_char_cpu.py", "config/modern.py",
                                                          "config/speedrun_char.py"])
    assert (raced.max_iters, raced.learning_rate, raced.value_embeds, raced.mlp_hidden) == (400, 4e-3, 1, 256)
    shutil.copytree(REPO_ROOT / "config", tmp_path / "config")
    with open(tmp_path / "config" / "speedrun_char.py", "a") as f:
        f.write("learning_rate = 3e-3\nmax_iters = 350\n")
    monkeypatch.chdir(tmp_path)
    edited = common.read_recipe(specs, "--speedrun_ours")
    assert (edited.learning_rate, edited.max_iters) == (3e-3, 350)


@pytest.fixture
def tiny_data(tmp_path):
    make_char_dataset(tmp_path / "data", TEXT)
    return tmp_path / "data"


def tiny_speedrun(tmp_path, data, **extra) -> list[str]:
    args = dict(device="cpu", dtype="float32", sections="speedrun", out=tmp_path / "bench.json",
                speedrun_data_dir=data, speedrun_seeds="1,2", speedrun_eval_every=10, speedrun_eval_fine=2,
                speedrun_chunk=7, speedrun_log_dir=tmp_path / "logs",
                speedrun_shape="n_layer=2,n_head=2,n_embd=32,block_size=16,batch_size=4,max_iters=40,"
                               "lr_decay_iters=40,warmup_iters=2,learning_rate=3e-3")
    return cli_args(args, **extra)


def test_nanogpt_runs_float32_on_a_cpu_and_ours_follows_the_runtime(tiny_data, monkeypatch):
    """nanoGPT's train.py has no autocast on a CPU: its side trains and scores in float32 even where ours
    runs bf16 autocast (a native-bf16 CPU's --dtype=auto)."""
    import torch
    from core import runtime
    from core.data.loader import read_meta

    seen, linear = [], torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda m, x: seen.append(linear(m, x).dtype) or linear(m, x))
    cfg = bench.load_config(tiny_speedrun(tiny_data, tiny_data))
    recipe = common.read_recipe(["n_layer=1", "n_head=2", "n_embd=32", "block_size=16", "batch_size=4"], "test")
    rt, vocab = runtime.Runtime("cpu", "cpu", "bfloat16"), read_meta(tiny_data)["vocab_size"]
    for name, want in (("nanogpt", torch.float32), ("ours", torch.bfloat16)):
        seen.clear()
        racer = speedrun.build_racer(name, recipe, 1, str(tiny_data), vocab, 2, cfg, rt, None)
        with one_thread():
            racer.step(0), racer.evaluate()
        assert seen and set(seen) == {want}, name


def test_ours_trains_on_the_warm_ups_windows_and_the_race_counts_their_tokens(tiny_data, monkeypatch):
    """With seq_len_warmup_iters, ours' micro-batches have seq_len_at's length (the read-ahead one
    included), and the tokens at the crossing are the ones it trained, not iterations x block_size."""
    import model as modellib
    from core import runtime
    from core.data.loader import read_meta

    shapes, forward = [], modellib.GPT.forward
    monkeypatch.setattr(modellib.GPT, "forward", lambda self, idx, *a, **k: shapes.append(tuple(idx.shape))
                        or forward(self, idx, *a, **k))
    cfg = bench.load_config(tiny_speedrun(tiny_data, tiny_data))
    recipe = common.read_recipe(["n_layer=1", "n_head=2", "n_embd=32", "block_size=16", "batch_size=4",
                                 "gradient_accumulation_steps=2", "seq_len_warmup_iters=4", "seq_len_warmup_start=4"],
                                "test")
    rt, vocab = runtime.Runtime("cpu", "cpu", "float32"), read_meta(tiny_data)["vocab_size"]
    r = speedrun.build_racer("ours", recipe, 1, str(tiny_data), vocab, 10, cfg, rt, None)
    r.evaluate = lambda: 5.0 if r.it < 6 else 1.0  # crosses at 6
    with one_thread():
        speedrun.race([r], chunk=10, target=2.0, every=6, fine_every=6, margin=0.0)
    lengths = [4, 4, 8, 12, 16, 16]  # 4 + 12 * it / 4 in multiples of 4, then block_size
    assert shapes == [(4, n) for n in lengths for _ in range(2)]
    assert r.reached["iter"] == 6 and r.reached["tokens"] == 8 * sum(lengths) == 480


@pytest.mark.slow
def test_speedrun_section_end_to_end_and_its_logs_plot_against_seconds(tmp_path, tiny_data, capsys):
    with one_thread():
        result = bench.main(tiny_speedrun(tmp_path, tiny_data, target=3.0))["speedrun"]
    out = capsys.readouterr().out
    assert "### Speedrun: training time to val loss 3.0000" in out and "| mean |" in out
    assert "seed 2 ours: iter 7, val loss " in out  # a line per turn
    assert result["target_source"] == "--target" and [s["seed"] for s in result["seeds"]] == [1, 2]
    for s in result["seeds"]:
        for name in ("nanogpt", "ours"):
            run, got = s["runs"][name], s["runs"][name]["reached"]
            assert got is not None and got["val_loss"] <= 3.0 and got["tokens"] == got["iter"] * 64, (s["seed"], name)
            assert [c[0] for c in run["curve"]][-1] == got["iter"] and run["eval_wall_s"] > 0
            assert run["alternated_chunks"] == max(1, -(-got["iter"] // 7))  # turns of speedrun_chunk=7
            assert all(prev[1] > 3.0 for prev in run["curve"][:-1])  # the first evaluation at the target ends it
    assert result["summary"]["ours"]["wall_ratio"] > 0
    # the two seeds differ (weights and batches), and each run is seeded alike: same first loss per seed
    first = {s["seed"]: [s["runs"][n]["curve"][0][1] for n in ("nanogpt", "ours")] for s in result["seeds"]}
    assert first[1] != first[2]
    logs = [tmp_path / "logs" / "1" / name for name in ("nanogpt", "ours")]
    runs = [plot.read_log(d) for d in logs]
    assert list(runs[0].evals) == [c[0] for c in result["seeds"][0]["runs"]["nanogpt"]["curve"]]
    png = plot.loss_main([*map(str, logs), "--x=cpu_seconds", "--target=3.0", f"--out={tmp_path / 'speedrun.png'}"])
    assert png.stat().st_size > 1000


def test_gpt2_preset_races_gpt2_smalls_shape():
    cfg = bench.load_config(["--preset=gpt2", "--sections=speedrun"])
    r = common.read_recipe([cfg.speedrun_base, *common.spec_list(cfg.speedrun_shape)], "test")
    assert {k: r.model_args()[k] for k in ("n_layer", "n_head", "n_embd", "block_size")} == dict(
        n_layer=12, n_head=12, n_embd=768, block_size=1024)
    assert speedrun.tokens_per_iter(r) == 16 * 1024


@pytest.mark.slow
def test_speedrun_measures_its_target_when_none_is_recorded(tmp_path, tiny_data):
    """The gpt2 preset's path (no recorded target: measured first), at a tiny shape on the CPU."""
    with one_thread():
        result = bench.main(tiny_speedrun(tmp_path, tiny_data, preset="gpt2", threads=1, speedrun_target_iters=12,
                                          speedrun_seeds="3", speedrun_runs="nanogpt",
                                          speedrun_eval_every=4))["speedrun"]
    assert result["target_source"].startswith("measured now: nanoGPT's loop at 12 iterations, seed 3")
    # the same seed, the same run, scored at 12: nanoGPT reaches its own 12-iteration loss by then
    run = result["seeds"][0]["runs"]["nanogpt"]
    assert 0 < run["reached"]["iter"] <= 12 and run["curve"][-1][1] <= result["target"]


@pytest.mark.parametrize("arg, fragment", [("--speedrun_runs=ours,gpt", "speedrun_runs must list"),
                                           ("--speedrun_seeds=a", "speedrun_seeds must be comma-separated"),
                                           ("--speedrun_max_iters_factor=0.5", "speedrun_max_iters_factor >= 1")])
def test_bad_speedrun_options_are_one_line(arg, fragment):
    with pytest.raises(UserError, match=fragment):
        bench.load_config([arg])


def test_wsd_holds_the_peak_then_falls_linearly_to_min_lr():
    lr = [optim.lr_at(it, 1.0, 0.1, 10, 100, "wsd", cooldown_frac=0.2) for it in range(110)]
    assert lr[9] < 1.0 and lr[10:81] == [1.0] * 71  # warmup, then stable until the last 20% of 100
    assert lr[90] == pytest.approx(0.55) and lr[100:] == [0.1] * 10  # a straight line to min_lr
    steps = [a - b for a, b in zip(lr[80:100], lr[81:101])]
    assert steps == pytest.approx([0.045] * 20)
    cosine = [optim.lr_at(it, 1.0, 0.1, 10, 100) for it in range(110)]
    assert cosine[55] == pytest.approx(0.55) and cosine[20] < 1.0  # the default stays nanoGPT's cosine


def test_plot_draws_speedrun_logs_against_training_seconds_and_refuses_logs_without_them(tmp_path):
    run = tmp_path / "ours"
    run.mkdir()
    records = [{"iter": i, "val_loss": 4.0 - i / 100, "train_s": 2.0 * i, "train_cpu_s": 0.5 * i, "lr": 1e-3}
               for i in (0, 50, 100)]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for x, key in (("seconds", "train_s"), ("cpu_seconds", "train_cpu_s")):
        fig = plot.plot_losses([plot.read_log(run)], x=x, target=3.5)
        val = [line for line in fig.axes[0].lines if line.get_marker() == "o"][0]
        assert list(val.get_xdata()) == [r[key] for r in records] and list(val.get_ydata()) == [4.0, 3.5, 3.0]
        assert 3.5 in [line.get_ydata()[0] for line in fig.axes[0].lines if line.get_linestyle() == ":"]
    (run / "log.jsonl").write_text(json.dumps({"iter": 0, "val_loss": 4.0, "train_loss": 4.0, "lr": 1e-3}) + "\n")
    with pytest.raises(UserError, match="--x=cpu_seconds needs train_cpu_s in every eval record"):
        plot.plot_losses([plot.read_log(run)], x="cpu_seconds")
