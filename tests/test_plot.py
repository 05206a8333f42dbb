"""plot.py: loss curves from log.jsonl, rl.py's rewards, attention maps and their layer x head summaries;
scripts/rl_proof.py's pass@k picture.

    python -m pytest tests/test_plot.py

Logs are written here by hand in train.py's format (JsonLog), so each value drawn can be checked
against the record it came from. Attention weights are checked against transformers' own
(output_attentions) on a model whose query/key weights are scaled up, so heads differ and are sharp.
"""
import importlib.util
import json
import math

import pytest
import torch

import plot
from core.weights.hf import to_transformers
from model import GPT, GPTConfig
from tests.helpers import (REPO_ROOT, assert_user_error, make_char_dataset, needs_transformers, run_main,
                           train_tiny)


def write_run(out_dir, lr=1e-3, batch_size=4, iters=range(0, 30, 3), evals=(0, 15, 30), extra_lines=(), **config):
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = dict(out_dir=str(out_dir), batch_size=batch_size, block_size=8, gradient_accumulation_steps=2,
               learning_rate=lr, n_layer=1, n_head=2, n_embd=16, wandb_run_name="x", init_from="scratch") | config
    (out_dir / "config.json").write_text(json.dumps(cfg))
    lines = []
    for it in range(0, 31):
        if it in evals:
            lines.append({"iter": it, "train_loss": 4.0 - it / 10, "val_loss": 4.1 - it / 10, "lr": lr * it / 30})
        if it in iters:
            lines.append({"iter": it, "loss": 4.0 - it / 12, "lr": lr * it / 30, "ms": 1.0, "tok_per_s": 5.0,
                          "mfu": None})
    (out_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "".join(extra_lines))
    return out_dir


def test_read_log_keeps_the_last_record_of_an_iteration_and_skips_a_cut_last_line(tmp_path):
    run = write_run(tmp_path / "a", extra_lines=[
        # a resumed run that redid iterations 27 and 30, then was killed while writing
        json.dumps({"iter": 27, "loss": 0.5, "lr": 1e-4, "ms": 1, "tok_per_s": 1, "mfu": None}) + "\n",
        json.dumps({"iter": 30, "train_loss": 0.7, "val_loss": 0.8, "lr": 1e-4}) + "\n",
        '{"iter": 33, "loss": 0.4, "lr"',
    ])
    log = plot.read_log(run)
    assert list(log.steps) == list(range(0, 30, 3)) and list(log.evals) == [0, 15, 30]
    assert log.steps[27]["loss"] == 0.5 and log.evals[30]["val_loss"] == 0.8
    assert log.tokens_per_iter == 4 * 8 * 2


def test_bad_logs_are_one_line(tmp_path):
    # after its 13 good lines, a bad one that is not the last: a damaged log, not a line being written
    write_run(tmp_path / "bad", extra_lines=["not json\n", json.dumps({"iter": 40, "loss": 1.0, "lr": 0.1}) + "\n"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "log.jsonl").write_text("")
    (tmp_path / "nolog").mkdir()
    cases = [(tmp_path / "bad", "line 14 is not a log record"), (tmp_path / "empty", "no logged iterations yet"),
             (tmp_path / "nolog", "has no log.jsonl"), (tmp_path / "missing", "is not a folder")]
    for path, fragment in cases:
        assert_user_error(run_main(plot.main, [str(path)]), fragment)
    assert_user_error(run_main(plot.main, []), "pass one or more out_dirs")
    assert_user_error(run_main(plot.main, [str(tmp_path / "bad"), "--x=time"]), "x must be 'iter', 'tokens', 'elapsed', 'seconds' or 'cpu_seconds'")


def test_two_runs_overlay_with_their_differences_in_the_labels(tmp_path):
    a = plot.read_log(write_run(tmp_path / "run-a"))
    b = plot.read_log(write_run(tmp_path / "run-b", lr=3e-4, evals=(0, 10, 20, 30), n_layer=2))
    assert plot.run_labels([a, b]) == ["run-a (learning_rate=0.001, n_layer=1)",
                                       "run-b (learning_rate=0.0003, n_layer=2)"]
    assert plot.run_labels([a]) == ["run-a (1L 2H 16d, 64 tok/iter)"]
    fig = plot.plot_losses([a, b])
    ax, ax_lr = fig.axes[:2]
    assert ax.get_ylabel().startswith("loss") and ax_lr.get_ylabel() == "learning rate"
    assert ax_lr.get_xlabel() == "iteration"
    top = [c for c in ax.child_axes if c.get_xlabel().startswith("tokens seen")]
    assert len(top) == 1 and top[0].get_xlabel() == "tokens seen (64 per iteration)"
    val = {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("run-")}
    assert list(val) == plot.run_labels([a, b])
    for run, line in zip((a, b), val.values()):
        assert list(line.get_xdata()) == list(run.evals)
        assert list(line.get_ydata()) == [r["val_loss"] for r in run.evals.values()]
    lr_lines = ax_lr.get_lines()
    assert [list(line.get_ydata()) for line in lr_lines] == [[r["lr"] for r in run.steps.values()] for run in (a, b)]
    unevaluated = plot.plot_losses([plot.read_log(write_run(tmp_path / "run-c", evals=()))]).axes[0]
    assert unevaluated.get_legend().get_texts()[0].get_text().startswith("run-c")  # a run yet to evaluate is named


def test_hellaswag_gets_a_panel_when_a_run_logged_it(tmp_path):
    a = plot.read_log(write_run(tmp_path / "a"))
    b = plot.read_log(write_run(tmp_path / "b", lr=3e-4))
    for it, record in b.evals.items():
        record["hellaswag_acc_norm"] = 0.25 + it / 100
    fig = plot.plot_losses([a, b])
    ax_hs = fig.axes[1]
    assert ax_hs.get_ylabel() == "HellaSwag acc_norm" and fig.axes[2].get_ylabel() == "learning rate"
    drawn = [line for line in ax_hs.get_lines() if len(line.get_xdata()) and line.get_linestyle() == "-"]
    assert [list(line.get_ydata()) for line in drawn] == [[0.25, 0.4, 0.55]]  # run a has none: an empty line
    assert not plot.plot_losses([a]).axes[1].get_ylabel().startswith("HellaSwag")


def test_against_tokens_when_the_runs_see_different_batches(tmp_path):
    a = plot.read_log(write_run(tmp_path / "a"))
    b = plot.read_log(write_run(tmp_path / "b", batch_size=8))
    fig = plot.plot_losses([a, b], x="tokens")
    ax, ax_lr = fig.axes[:2]
    assert ax_lr.get_xlabel() == "tokens seen" and not ax.child_axes
    val = [line for line in ax.get_lines() if line.get_label().startswith(("a ", "b "))]
    assert [list(line.get_xdata()) for line in val] == [[0, 15 * 64, 30 * 64], [0, 15 * 128, 30 * 128]]
    fig = plot.plot_losses([a, b])  # by iteration: no single tokens axis fits both
    assert not fig.axes[0].child_axes


def test_tokens_seen_count_the_shorter_windows_of_sequence_length_warm_up(tmp_path, capsys):
    """Block 64 warmed up from 16 over 6 iterations trains windows of 16, 16, 32, 32, 48, 48 tokens
    (core.training.train_config.seq_len_at), 8 rows each: 8 x 192 tokens before iteration 6, then 8 x 64 a step."""
    run = plot.read_log(write_run(tmp_path / "warm", block_size=64, seq_len_warmup_iters=6, seq_len_warmup_start=16))
    assert [run.tokens_seen(it) for it in (0, 3, 6, 15, 30)] == [0, 8 * 64, 8 * 192, 8 * (192 + 9 * 64),
                                                                 8 * (192 + 24 * 64)]
    fig = plot.plot_losses([run], x="tokens")
    val = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("warm")]
    assert [list(line.get_xdata()) for line in val] == [[0, 8 * 768, 8 * 1728]]
    assert not plot.plot_losses([run]).axes[0].child_axes  # by iteration: no linear tokens axis fits
    assert "sequence-length warm-up" in capsys.readouterr().err


def test_against_wall_time_from_each_records_elapsed_s(tmp_path):
    """--x=elapsed puts every record (steps and evals) at its elapsed_s; a log written without it is one line.
    --x=seconds puts the evals at their train_s, and leaves out the steps (which carry none)."""
    out = write_run(tmp_path / "a")
    stamped = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    (out / "log.jsonl").write_text("".join(json.dumps(r | {"elapsed_s": 2.0 * r["iter"] + ("val_loss" in r)} | (
        {"train_s": r["iter"] / 2} if "val_loss" in r else {})) + "\n" for r in stamped))
    ax = plot.plot_losses([plot.read_log(out)], x="seconds").axes[0]
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[0.0, 7.5, 15.0]] * 2  # val and train loss
    fig = plot.plot_losses([plot.read_log(out)], x="elapsed")
    ax, ax_lr = fig.axes[:2]
    assert ax_lr.get_xlabel() == "seconds since the run started (wall clock)"
    assert list(ax.get_lines()[1].get_xdata()) == [1.0, 31.0, 61.0]  # the evals, at their own elapsed_s
    assert list(ax.get_lines()[0].get_xdata()) == [2.0 * it for it in range(0, 30, 3)]  # each logged step
    assert_user_error(run_main(plot.main, [str(write_run(tmp_path / "old")), "--x=elapsed"]), "--x=elapsed needs elapsed_s")


def test_plot_command_writes_a_png_of_a_real_run(tmp_path):
    make_char_dataset(tmp_path / "data", "to be or not to be, that is the question. " * 40)
    train_tiny(tmp_path / "run", tmp_path / "data", max_iters=20, eval_interval=10, log_interval=2)
    with open(tmp_path / "run" / "log.jsonl", "a") as f:
        f.write('{"iter": 21, "lo')  # a run writing its next line
    result = run_main(plot.main, [str(tmp_path / "run"), str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr
    png = (tmp_path / "run" / "loss.png").read_bytes()  # beside the first run by default
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# -----------------------------------------------------------------------------
# attention


def sharp_model(n_layer=2, n_head=4):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=n_layer, n_head=n_head, n_embd=8 * n_head)).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(25)  # sharp, different heads; the values too, harmlessly
    return model


def test_attention_maps_equal_transformers(tmp_path):
    transformers = needs_transformers()
    model = sharp_model()
    to_transformers(model).save_pretrained(tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    att = plot.attention_maps(model, ids)  # (L, nh, T, T)
    with torch.no_grad():
        theirs = torch.stack(hf(torch.tensor([ids]), output_attentions=True).attentions)[:, 0]
    torch.testing.assert_close(att, theirs, atol=1e-5, rtol=0)
    assert (att[:, :, 1:].max(-1).values > 0.9).float().mean() > 0.3  # sharp: a wrong head or layer would show
    assert not torch.allclose(att[0, 0], att[0, 1], atol=0.1)


def test_distance_and_entropy_of_known_patterns():
    T = 6
    previous = torch.zeros(T, T)
    previous[0, 0] = 1
    previous[torch.arange(1, T), torch.arange(0, T - 1)] = 1  # every query attends to the token before it
    first = torch.zeros(T, T)
    first[:, 0] = 1  # every query attends to the first token
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    att = torch.stack([previous, first, uniform])
    queries = range(1, T)
    torch.testing.assert_close(plot.mean_distance(att), torch.tensor(
        [1.0, sum(queries) / 5, sum(i / 2 for i in queries) / 5]))
    torch.testing.assert_close(plot.entropy(att), torch.tensor([0.0, 0.0, sum(math.log(i + 1) for i in queries) / 5]))


def test_attention_command_draws_heads_and_summary(tmp_path):
    make_char_dataset(tmp_path / "data", "to be or not to be, that is the question. " * 40)
    train_tiny(tmp_path / "run", tmp_path / "data", max_iters=10, n_layer=2)
    args = ["attention", f"--out_dir={tmp_path / 'run'}", "--prompt=to be or not", "--layer=-1"]
    result = run_main(plot.main, args + ["--summary=entropy"])
    assert result.returncode == 0, result.stderr
    for name in ("attention.png", "attention_summary.png"):
        assert (tmp_path / "run" / name).read_bytes()[:4] == b"\x89PNG"
    cases = [(["--layer=2"], "layer 2 does not exist: the model has 2 layers"),
             (["--max_tokens=5"], "the prompt is 12 tokens; draw 2 to 5"),
             (["--prompt=Q"], "outside this"),
             (["--summary=max"], "summary must be")]
    for extra, fragment in cases:
        assert_user_error(run_main(plot.main, args + extra), fragment)


def test_heads_figure_draws_each_head_with_tokens_on_both_axes():
    model = sharp_model(n_layer=1, n_head=3)
    att = plot.attention_maps(model, list(range(5)))
    fig = plot.plot_heads(att[0], list("abcde"), "t")
    panels = [ax for ax in fig.axes if ax.get_title().startswith("head")]
    assert [ax.get_title() for ax in panels] == ["head 0", "head 1", "head 2"]
    for h, ax in enumerate(panels):
        image = ax.get_images()[0].get_array()
        torch.testing.assert_close(torch.from_numpy(image.filled(0.0)).float(), att[0, h])
        assert image.mask[0, 1] and not image.mask[1, 0]  # rows are queries: keys after them are masked
        assert [t.get_text() for t in ax.get_xticklabels()] == list("abcde")
        assert [t.get_text() for t in ax.get_yticklabels()] == list("abcde")


def write_rl_run(out_dir, evals=(0, 10, 20)):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"out_dir": str(out_dir), "tasks": "reverse,upper"}))
    lines = []
    for it in range(21):
        if it in evals:  # rl.py writes an eval's record before the iteration's
            lines.append({"iter": it, "heldout_reverse": 0.3 + it / 100, "heldout_upper": 0.5 + it / 200})
        if it < 20:
            lines.append({"iter": it, "lr": 1e-3, "reward": it / 40, "reward_max": 1.0, "exact": it / 40,
                          "reply_tokens": 5.0 + it / 20, "loss": -0.01})
    (out_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out_dir


def test_an_rl_run_draws_rewards_and_each_tasks_heldout_exact_match(tmp_path):
    run = plot.read_log(write_rl_run(tmp_path / "rl"))
    assert list(run.evals) == [0, 10, 20] and list(run.steps) == list(range(20))  # an eval is not an iteration's
    fig = plot.plot_rewards([run])
    ax, ax_len, ax_lr = fig.axes
    lines = [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines() if len(line.get_xdata())]
    assert (list(range(20)), [it / 40 for it in range(20)]) in lines  # each iteration's mean reward
    assert ([0, 10, 20], [0.3, 0.4, 0.5]) in lines and ([0, 10, 20], [0.5, 0.55, 0.6]) in lines  # held-out
    moving = next(y for x, y in lines if len(x) == 20 and y != [it / 40 for it in range(20)])
    assert moving[15] == sum(it / 40 for it in range(6, 16)) / 10  # the mean over the last 10 iterations
    assert list(ax_len.get_lines()[0].get_ydata()) == [5.0 + it / 20 for it in range(20)]
    assert (ax_len.get_ylabel(), ax_lr.get_ylabel(), ax_lr.get_xlabel()) == ("reply tokens", "learning rate", "iteration")
    result = run_main(plot.main, [str(tmp_path / "rl")])
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rl" / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_user_error(run_main(plot.main, [str(tmp_path / "rl"), str(write_run(tmp_path / "lm"))]),
                      "is an rl.py run and", "is not; plot rewards and losses separately")


def test_rl_proof_results_draw_pass_at_k_per_task_split_and_arm(tmp_path):
    """scripts/rl_proof.py's picture: a panel per task and split, each arm's seeds faint and their mean solid."""
    def scores(base):
        return {task: {split: {"greedy": base, "pass@k": {"1": base, "8": base + 0.2, "64": base + 0.4}}
                       for split in ("heldout", "longer")} | {"demos_heldout": {"greedy": 0.9}}
                for task in ("sort", "palindrome")}

    spec = importlib.util.spec_from_file_location("rl_proof", REPO_ROOT / "scripts" / "rl_proof.py")
    spec.loader.exec_module(rl_proof := importlib.util.module_from_spec(spec))
    runs = {"SFT": {"scores": scores(0.1)}, "RFT 1": {"scores": scores(0.2)}, "RFT 2": {"scores": scores(0.4)}}
    fig = rl_proof.plot_passk({"runs": runs}, tmp_path / "rl_passk.png")
    assert [ax.get_title() for ax in fig.axes] == ["sort, heldout", "sort, longer", "palindrome, heldout",
                                                   "palindrome, longer"]
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[3].get_lines()}
    assert lines["SFT (1 seed)"] == pytest.approx([0.1, 0.3, 0.5])
    assert lines["RFT (2 seeds)"] == pytest.approx([0.3, 0.5, 0.7])  # the mean of the two seeds
    assert list(fig.axes[3].get_lines()[0].get_xdata()) == [1, 8, 64]
    assert (tmp_path / "rl_passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
