"""rl.py and the tasks it learns (core/data/tasks.py): the tasks' split and checkers, the step as the policy
gradient, a known optimum reached, exact resume, one process equal to two, the stop flag, the KL term, bad
input, and eval.py --task agreeing with the server's chat endpoint.

    python -m pytest tests/test_rl.py -q

The model is a tiny character chat run: a base trained one step, fine-tuned to answer "letter: xyz" with one
random letter. The test tasks are registered as a user would add one (one make, one check): "letter" rewards
the reply "e" (its optimum: always "e"), "vowel" any vowel, "any" every reply.
"""
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn import functional as F

import eval as eval_script
import rl
from core.data import tasks as tasklib
from core.data.chat import ChatTemplate
from core.evaluation.answers import pass_at_k
from core.decoding.replies import reply_text, sample_replies, sample_seed, sampler
from core.training import optim
from core.weights import checkpoint, resolver
from tests.helpers import (REPO_ROOT, assert_user_error, make_char_dataset, make_chat_dataset, one_thread, records,
                           run_main, run_script, train_tiny)

ALPHA = "abcdefghijklmnopqrstuvwxyz"
ARCH = dict(n_layer=2, n_embd=64, block_size=32)
# The test tasks, as a user adds one: a make and a check. Also written into the wrapper that torchrun runs.
TEST_TASKS = '''
from core.data.tasks import TASKS, Problem, Task, random_letters

def make_letter(rng):
    text = random_letters(rng)
    return Problem(f"letter: {text}", "e", text)

TASKS["letter"] = Task(make_letter, lambda problem, reply: float(reply == "e"))
TASKS["vowel"] = Task(make_letter, lambda problem, reply: float(reply in ("a", "e", "i", "o", "u")))
TASKS["any"] = Task(make_letter, lambda problem, reply: 1.0)
'''
RL_TINY = dict(tasks="letter", prompts_per_iter=8, samples_per_prompt=8, eval_interval=10, eval_examples=20,
               learning_rate=5e-3, min_lr=5e-3, max_iters=40, device="cpu", dtype="float32", log_interval=1)


@pytest.fixture(scope="module", autouse=True)
def test_tasks():
    exec(TEST_TASKS, {})
    yield
    for name in ("letter", "vowel", "any"):
        del tasklib.TASKS[name]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A base model and its chat fine-tune that answers "letter: ..." with one letter, mostly not "e"."""
    tmp = tmp_path_factory.mktemp("rl")
    make_char_dataset(tmp / "base_data", f"letter: upper: reverse: {ALPHA} {ALPHA.upper()}\n" * 40)
    train_tiny(tmp / "base", tmp / "base_data", max_iters=1, **ARCH)
    rng = random.Random(0)
    convs = [[{"role": "user", "content": f"letter: {tasklib.random_letters(rng)}"},
              {"role": "assistant", "content": rng.choice(ALPHA)}] for _ in range(300)]
    make_chat_dataset(tmp / "chat", convs, tokenizer_from=tmp / "base", block_size=32)
    train_tiny(tmp / "sft", tmp / "chat", init_from=str(tmp / "base"), max_iters=100, lr_decay_iters=100,
               batch_size=16, learning_rate=5e-3, min_lr=5e-4, eval_interval=100, log_interval=50, **ARCH)
    return tmp


def rl_args(chat_run, out_dir, **overrides) -> list[str]:
    settings = RL_TINY | {"init_from": str(chat_run / "sft"), "out_dir": str(out_dir)} | overrides
    return [f"--{k}={v}" for k, v in settings.items()]


def run_rl(chat_run, out_dir, **overrides) -> subprocess.CompletedProcess:
    result = run_main(rl.main, rl_args(chat_run, out_dir, **overrides))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def steps(out_dir) -> list[dict]:
    """The iteration records of an RL run's log, without the clock's fields."""
    return [r for r in records(out_dir, timings=False) if "reward" in r]


def heldout(out_dir, task="letter") -> dict[int, float]:
    return {r["iter"]: r[f"heldout_{task}"] for r in records(out_dir) if f"heldout_{task}" in r}


# -----------------------------------------------------------------------------
# the tasks


def test_splits_never_overlap_and_the_checkers_score():
    for name in ("reverse", "upper", "add", "sort", "palindrome"):
        task = tasklib.TASKS[name]
        splits = ("train", "heldout") + (("demos", "demos_heldout", "longer") if task.demos else ())
        drawn = {split: tasklib.distinct_problems(name, split, 2000, seed=1) if split in ("train", "demos") else
                 tasklib.problems(name, split, 200) for split in splits}
        for a in ("train", "demos") if task.demos else ("train",):  # no key trained on is a held-out one
            assert not any({p.key for p in drawn[a]} & {p.key for p in drawn[b]} for b in splits
                           if b in ("heldout", "demos_heldout", "longer")), (name, a)
        for split in ("heldout", "demos_heldout", "longer") if task.demos else ("heldout",):
            assert drawn[split] == tasklib.problems(name, split, 200) and len({p.key for p in drawn[split]}) == 200
        for split, problems in drawn.items():  # answers shown only where demonstrations exist, and accepted
            shown = [p for p in problems if p.answer is not None]
            assert len(shown) == (len(problems) if split.startswith("demos") or not task.demos else 0), (name, split)
            assert all(task.check(p, p.answer) == 1.0 and task.check(p, p.answer + " ") == 0.0 for p in shown[:50])
        if task.demos:  # the lengths: RL's prompts and their held-out twins 6 and 7, a few demonstrations there
            for split, lengths in (("demos", {3, 4, 5, 6, 7, 8}), ("heldout", {6, 7}), ("longer", {9, 10})):
                assert {len(p.key) for p in drawn[split]} == lengths, (name, split)
            assert 0.01 < sum(len(p.key) in (6, 7) for p in drawn["demos"]) / 2000 < 0.03, name
    for p in tasklib.problems("add", "heldout", 100):
        a, b = map(int, p.prompt.removeprefix("add: ").split("+"))
        assert p.answer == str(a + b) and 10 <= a <= 999 and 10 <= b <= 999
    assert tasklib.TASKS["reverse"].check(tasklib.Problem("reverse: abc", "cba", "abc"), "abc") == 0.0
    held_share = sum(tasklib.split_of(str(k)) == "heldout" for k in range(10000)) / 10000
    assert 0.08 < held_share < 0.12
    assert_user_error_raised(lambda: tasklib.problems("reverse", "longer", 5), "task 'reverse' has no longer split")
    assert_user_error_raised(lambda: tasklib.problems("sort", "train", 5), "not 'train'")


@pytest.mark.parametrize("name, key, right, near_misses", [
    ("sort", "dbcab", ["abbcd"], ["abcbd", "abcd", "abbbcd", "abbcd ", "ABBCD", "dcbba", "bacbd", ""]),
    ("palindrome", "abc", ["abcba", "abccba", "abcxcba", "abcbcba"],
     ["abcab", "abcb", "bcb", "cba", "abc", "abc cba", "abcbA", "abccb", "Abcba", "xabcbax", ""]),
    ("palindrome", "aba", ["aba", "abaaba", "ababa"], ["abba", "ab", "abab"]),
])
def test_the_checkers_accept_every_right_answer_and_reject_near_misses(name, key, right, near_misses):
    problem = tasklib.Problem(f"{name}: {key}", None, key)
    assert [tasklib.TASKS[name].check(problem, r) for r in right] == [1.0] * len(right)
    assert [tasklib.TASKS[name].check(problem, r) for r in near_misses] == [0.0] * len(near_misses)


def assert_user_error_raised(call, fragment):
    with pytest.raises(tasklib.UserError, match=fragment):
        call()


def test_chat_tasks_script_writes_each_tasks_demonstrations_and_their_heldout_set(tmp_path):
    """SFT conversations come from each task's demonstrations: reverse's and add's train problems, sort's short
    ones (3, 4, 5 and 8 letters, and one in fifty of 6 or 7), each answer the checker's."""
    spec_path = REPO_ROOT / "data" / "chat" / "tasks.py"
    result = run_script(str(spec_path), f"--out_dir={tmp_path}", "--tasks=reverse,add,sort", "--n_train=300",
                        "--n_heldout=20")
    assert result.returncode == 0, result.stderr
    train, held = ([json.loads(line)["messages"] for line in (tmp_path / name).read_text().splitlines()]
                   for name in ("tasks_train.jsonl", "tasks_heldout.jsonl"))
    assert len(train) == 300 and len(held) == 60
    expected = [p for name in ("reverse", "add", "sort") for p in tasklib.problems(name, "demos_heldout", 20)]
    assert expected[:20] == tasklib.problems("reverse", "heldout", 20)  # a task without demos: its held-out set
    assert [(m[-2]["content"], m[-1]["content"]) for m in held] == [(p.prompt, p.answer) for p in expected]
    for messages in train:
        task, key = messages[-2]["content"].split(": ", 1)
        assert tasklib.split_of(key) == "train" and task in ("reverse", "add", "sort")
        assert task != "sort" or 3 <= len(key) <= 8
        problem = tasklib.Problem(messages[-2]["content"], messages[-1]["content"], key)
        assert tasklib.TASKS[task].check(problem, {"reverse": key[::-1]}.get(task, messages[-1]["content"])) == 1.0
    assert any(m[0]["role"] == "system" for m in train) and {m[-2]["content"][:4] for m in train} == {"reve", "add:", "sort"}


# -----------------------------------------------------------------------------
# the step


def test_pack_makes_only_reply_tokens_targets():
    rows = [([5, 6, 7], [8, 9]), ([5], [4, 3])]
    x, y = rl.pack(rows, "cpu")
    assert x.tolist() == [[5, 6, 7, 8], [5, 4, 0, 0]]
    assert y.tolist() == [[-1, -1, 8, 9], [4, 3, -1, -1]]


@pytest.mark.parametrize("update, std, batch_size", [("reinforce", False, 0), ("reinforce", True, 0),
                                                     ("reinforce", False, 24), ("rft", False, 0), ("rft", False, 24)])
def test_the_step_is_the_policy_gradient_over_the_replies(chat_run, tmp_path, monkeypatch, update, std, batch_size):
    """The gradient of rl.py's first step equals REINFORCE's, computed here row by row without padding: each
    reply's reward minus its group's mean (over the group's std with std_advantage), times the gradient of its
    tokens' log-probabilities, summed over every reply token and divided by their number, negated. update=rft is
    SFT on the accepted replies alone: their tokens' log-probabilities over the accepted replies' tokens, the
    rejected replies nowhere. With batch_size the 64 rows go through in chunks of 24, 24 and 16, accumulated to the
    same gradient."""
    grads = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        if not grads:
            grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    settings = dict(max_iters=1, grad_clip=0, std_advantage=std, tasks="vowel", eval_interval=100,
                    batch_size=batch_size, update=update)
    run_rl(chat_run, tmp_path / "rl", **settings)
    cfg = rl.RLConfig(**(RL_TINY | settings))

    model, tok, _ = resolver.load_model(str(chat_run / "sft"), str(chat_run / "sft"))
    template = ChatTemplate.for_tokenizer(tok)
    problems = [rl.problem_at(cfg.seed, 0, j, ["vowel"])[1] for j in range(cfg.prompts_per_iter)]
    prompts = [template.render_prompt(tasklib.messages(p)) for p in problems]
    replies = sample_replies(model.eval(), template, prompts, cfg.samples_per_prompt, cfg.max_new_tokens,
                             generators=[sampler(cfg.seed, 0, j) for j in range(cfg.prompts_per_iter)])
    rows = [(prompt, r) for prompt, group in zip(prompts, replies) for r in group]
    rewards = [[tasklib.TASKS["vowel"].check(p, reply_text(template, r)) for r in group]
               for p, group in zip(problems, replies)]
    assert 0 < sum(map(sum, rewards)) < len(rows), "the group rewards must differ for the test to mean anything"
    model.train()
    counted = [(prompt, reply) for (prompt, reply), reward in zip(rows, sum(rewards, []))
               if update == "reinforce" or reward == 1]
    n_tokens = sum(len(reply) for _, reply in counted)
    objective = 0.0
    for (prompt, reply), reward, group in zip(rows, [r for g in rewards for r in g],
                                              [g for g in rewards for _ in g]):
        mean = sum(group) / len(group)
        spread = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        weight = (reward - mean) / (spread + 1e-6 if std else 1.0) if update == "reinforce" else reward
        if weight == 0:
            continue
        seq = torch.tensor([prompt + reply])
        logits = model(seq[:, :-1])[0][0]  # (T, vocab)
        logp = F.log_softmax(logits, dim=-1)[len(prompt) - 1:].gather(1, torch.tensor(reply)[:, None]).sum()
        objective = objective + weight * logp
    (-objective / n_tokens).backward()
    expected = optim.build_optimizer(model, "adamw", cfg.learning_rate, 0.0, (0.9, 0.95), "cpu")
    want = [p.grad for g in expected.param_groups for p in g["params"]]
    assert len(want) == len(grads[0])
    for got, exp in zip(grads[0], want):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-6)
    tokens = sum(len(prompt) + len(reply) - 1 for prompt, reply in rows)
    assert steps(tmp_path / "rl")[0]["tokens"] == 3 * tokens  # the replies' forward, the step's forward and backward


def test_a_prompts_replies_follow_from_its_generator_alone_or_batched_with_others(chat_run):
    """rl.py samples every prompt of an iteration in one decode, prompts of different lengths side by side: each
    prompt's replies are those it gets alone from its generator (and so on any number of processes), sampled
    and greedy; sampled, a prompt's rows differ."""
    model, tok, _ = resolver.load_model(str(chat_run / "sft"), str(chat_run / "sft"))
    template = ChatTemplate.for_tokenizer(tok)
    problems = [rl.problem_at(0, 0, j, ["letter"])[1] for j in range(6)]
    prompts = [template.render_prompt(tasklib.messages(p)) for p in problems]
    assert len({len(p) for p in prompts}) > 1  # ragged
    for temperature in (1.0, 0.0):
        together = sample_replies(model.eval(), template, prompts, 4, 8, temperature,
                                  generators=[sampler(3, j) for j in range(6)])
        alone = [sample_replies(model, template, [p], 4, 8, temperature, generators=[sampler(3, j)])[0]
                 for j, p in enumerate(prompts)]
        assert together == alone
        assert all(r[-1] == template.end_of_turn or len(r) == 8 for group in together for r in group)
    sampled = sample_replies(model, template, prompts, 4, 8, generators=[sampler(3, j) for j in range(6)])
    assert sum(len({tuple(r) for r in group}) for group in sampled) > len(prompts)  # the rows of a prompt differ


def test_a_known_optimum_is_reached(chat_run, tmp_path):
    """Reward 1 only for the reply "e": from a model that answers a random letter, the held-out exact match
    reaches 1 within 30 iterations."""
    run_rl(chat_run, tmp_path / "rl", max_iters=30)
    scores = heldout(tmp_path / "rl")
    assert scores[0] < 0.3, scores  # the bar is real: the fine-tune alone rarely says "e"
    assert scores[30] >= 0.95, scores
    logged = steps(tmp_path / "rl")
    assert [r["iter"] for r in logged] == list(range(30))
    assert sum(r["reward"] for r in logged[-5:]) / 5 >= 0.9
    for r in logged:
        assert 0 <= r["reward"] <= r["reward_max"] <= 1 and r["exact"] == r["reward"]  # a 0/1 checker
        assert 1 <= r["reply_tokens"] <= RL_TINY.get("max_new_tokens", 16)


def test_equal_rewards_teach_nothing(chat_run, tmp_path):
    """Every reply accepted: each advantage is 0 (the baseline is the group's mean), so the weights stay."""
    for std in (False, True):
        run_rl(chat_run, tmp_path / f"rl{std}", tasks="any", max_iters=3, std_advantage=std, weight_decay=0.0)
        before = torch.load(chat_run / "sft" / "ckpt.pt", weights_only=True)["model"]
        after = torch.load(tmp_path / f"rl{std}" / "ckpt.pt", weights_only=True)["model"]
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(r["reward"] == 1.0 for r in steps(tmp_path / f"rl{std}"))


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_resume_continues_bit_for_bit(chat_run, tmp_path, kl_coef):
    """Six iterations straight, and three then a resume for three more: the same replies, rewards, losses and
    weights (the prompts and each prompt's generator follow from seed, iteration and prompt; the KL term's
    reference is the run it started from, not the policy it resumes)."""
    run_rl(chat_run, tmp_path / "whole", max_iters=6, eval_interval=3, kl_coef=kl_coef)
    run_rl(chat_run, tmp_path / "parts", max_iters=3, eval_interval=3, kl_coef=kl_coef)
    run_rl(chat_run, tmp_path / "parts", init_from="resume", max_iters=6, eval_interval=3, kl_coef=kl_coef)
    assert steps(tmp_path / "parts") == steps(tmp_path / "whole")
    assert heldout(tmp_path / "parts") == heldout(tmp_path / "whole")
    whole = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)
    parts = torch.load(tmp_path / "parts" / "ckpt.pt", weights_only=True)
    assert all(torch.equal(whole["model"][k], parts["model"][k]) for k in whole["model"])
    assert checkpoint.load_checkpoint(tmp_path / "parts" / "ckpt.pt")["meta"]["started_from"] == str(chat_run / "sft")


def test_a_signal_finishes_the_iteration_saves_and_says_how_to_continue(chat_run, tmp_path, monkeypatch):
    calls = []
    held, prompts, samples = 4, 2, 8  # replies scored by the eval at iter 0, then by each iteration
    signal_at = held + 2 * prompts * samples + 3  # the 3rd reply scored in iteration 2: as if Ctrl-C came then

    def check(problem, reply):
        calls.append(reply)
        if len(calls) == signal_at:
            signal.raise_signal(signal.SIGINT)
        return float(reply == "e")

    monkeypatch.setitem(tasklib.TASKS, "letter", tasklib.Task(tasklib.TASKS["letter"].make, check))
    result = run_main(rl.main, rl_args(chat_run, tmp_path / "rl", max_iters=10, eval_examples=held,
                                       prompts_per_iter=prompts, samples_per_prompt=samples))
    assert result.returncode == 0, result.stderr
    assert "stopped at iter 3; continue with: python rl.py --init_from=resume" in result.stdout, result.stdout
    assert checkpoint.load_checkpoint(tmp_path / "rl" / "ckpt.pt")["meta"]["iter_num"] == 3
    assert [r["iter"] for r in steps(tmp_path / "rl")] == [0, 1, 2]
    assert len(calls) == held + 3 * prompts * samples  # iteration 2 was finished, nothing after it


def test_kl_penalty_holds_the_policy_to_the_start(chat_run, tmp_path):
    """With kl_coef the KL to the fine-tune is logged (0 at the first iteration, where the policy is the
    reference) and a large coefficient keeps it small and the reward lower than a small one does."""
    for coef in (0.01, 3.0):
        run_rl(chat_run, tmp_path / f"kl{coef}", max_iters=15, kl_coef=coef)
    small, large = steps(tmp_path / "kl0.01"), steps(tmp_path / "kl3.0")
    assert small[0]["kl"] == 0.0 and large[0]["kl"] == 0.0
    assert sum(r["kl"] for r in large[5:]) < sum(r["kl"] for r in small[5:]) / 3
    assert sum(r["reward"] for r in large[5:]) < sum(r["reward"] for r in small[5:])
    run_rl(chat_run, tmp_path / "nokl", max_iters=2)
    assert "kl" not in steps(tmp_path / "nokl")[0]


# -----------------------------------------------------------------------------
# processes


TORCHRUN_WRAPPER = '''
import sys
sys.path.insert(0, {repo!r})
{tasks}
import rl
from core.errors import run_cli
run_cli(rl.main)
'''


@pytest.mark.slow
def test_two_processes_sample_and_step_as_one(chat_run, tmp_path):
    """torchrun with 2 processes on gloo, each its own half of the prompts: the same replies and rewards as one
    process, the loss to float rounding (the gradient's sum is split across processes). The weights agree to
    1e-3 only: Adam divides each gradient by its own running size, so a weight whose gradient is near 0 moves by
    up to the learning rate either way on a rounding difference."""
    wrapper = tmp_path / "run_rl.py"
    wrapper.write_text(TORCHRUN_WRAPPER.format(repo=str(REPO_ROOT), tasks=textwrap.dedent(TEST_TASKS)))
    args = rl_args(chat_run, "OUT", max_iters=4, eval_interval=4)
    env = {"OMP_NUM_THREADS": "1"}
    commands = [[sys.executable, str(wrapper), *[a.replace("OUT", str(tmp_path / "one")) for a in args]],
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(wrapper),
                 *[a.replace("OUT", str(tmp_path / "two")) for a in args]]]
    procs = [subprocess.run(c, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=os.environ | env)
             for c in commands]
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    one, two = steps(tmp_path / "one"), steps(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        assert {k: a[k] for k in ("iter", "reward", "reward_max", "exact", "reply_tokens")} == \
               {k: b[k] for k in ("iter", "reward", "reward_max", "exact", "reply_tokens")}
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    assert heldout(tmp_path / "one") == heldout(tmp_path / "two")
    w1 = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=True)["model"]
    w2 = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=True)["model"]
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-3)


def test_prompts_split_evenly_or_refused(chat_run, tmp_path, monkeypatch):
    monkeypatch.setattr(rl.runtime, "setup", lambda *a, **k: rl.runtime.Runtime("cpu", "cpu", "float32", 0, 0, 2))
    monkeypatch.setattr(rl.runtime, "teardown", lambda rt: None)
    result = run_main(rl.main, rl_args(chat_run, tmp_path / "rl", prompts_per_iter=3))
    assert_user_error(result, "prompts_per_iter (3) must be divisible by the number of processes (2)")


# -----------------------------------------------------------------------------
# the command line


@pytest.mark.parametrize("overrides, fragment", [
    (dict(tasks="letter,nope"), "unknown task 'nope'; tasks are"),
    (dict(samples_per_prompt=1), "samples_per_prompt must be at least 2"),
    (dict(temperature=0), "temperature must be > 0"),
    (dict(kl_coef=-1), "must be at least 0"),
    (dict(tasks="add"), "task 'add' does not fit the vocabulary of"),
    (dict(init_from="no/such/run"), "unknown init_from 'no/such/run'"),
])
def test_bad_input_is_one_line(chat_run, tmp_path, overrides, fragment):
    assert_user_error(run_main(rl.main, rl_args(chat_run, tmp_path / "rl", **overrides)), fragment)
    assert not (tmp_path / "rl").exists()


def test_a_base_model_is_refused_and_a_used_out_dir_kept(chat_run, tmp_path):
    assert_user_error(run_main(rl.main, rl_args(chat_run, tmp_path / "rl", init_from=str(chat_run / "base"))),
                      "has no chat tokens (a base model): fine-tune it on conversations first")
    run_rl(chat_run, tmp_path / "rl", max_iters=1)
    assert_user_error(run_main(rl.main, rl_args(chat_run, tmp_path / "rl", max_iters=2)),
                      "already holds a run's checkpoint", "--init_from=resume")


def test_help_describes_every_key():
    result = run_script("rl.py", "--help")
    assert result.returncode == 0, result.stderr
    for name, helptext in __import__("core.config", fromlist=["field_help"]).field_help(rl.RLConfig).items():
        assert f"--{name}=" in result.stdout and helptext and helptext in result.stdout, name


# -----------------------------------------------------------------------------
# eval.py --task and the server


def test_eval_task_reports_greedy_exact_match_and_pass_at_k(chat_run):
    def run(*args):
        result = run_main(eval_script.main, [f"--out_dir={chat_run / 'sft'}", "--task=vowel", "--task_examples=30",
                                             "--device=cpu", "--dtype=float32", *args])
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    greedy = run()
    assert greedy.startswith("vowel heldout: exact match ") and greedy.endswith("/30), greedy")
    sampled = run("--samples=8", "--temperature=1")
    mean, *passk = (float(sampled.split(key)[1].split()[0].strip(","))
                    for key in ("mean reward ", "pass@2 ", "pass@4 ", "pass@8 "))
    assert 0 < mean < passk[0] < passk[1] < passk[2] <= 1, sampled
    assert run("--samples=8", "--temperature=1") == sampled  # seeded
    assert_user_error(run_main(eval_script.main, [f"--out_dir={chat_run / 'sft'}", "--task=vowel",
                                                  "--task_split=longer"]), "task 'vowel' has no longer split")
    assert_user_error(run_main(eval_script.main, [f"--out_dir={chat_run / 'sft'}", "--task=vowel", "--samples=4"]),
                      "temperature must be >= 0, and > 0 for more than one sample")


def test_pass_at_k_is_the_chance_that_k_of_the_n_replies_hold_an_accepted_one():
    """Chen et al.'s estimator against counting: of every k-subset of n replies (c accepted), the share holding one."""
    for n in range(1, 8):
        for c in range(n + 1):
            replies = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(replies, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)


def test_the_server_and_the_checker_give_eval_py_s_numbers(chat_run, tmp_path):
    """The held-out problems asked through serve.py's chat endpoint (the openai client), each reply scored by the
    task's checker: the same replies and the same score as eval.py --task=vowel, greedy and sampled (one reply per
    problem at temperature 1, the server given the seed eval.py's generator for that problem has)."""
    pytest.importorskip("openai")
    from tests.test_serve import running

    n = 30
    problems = tasklib.problems("vowel", "heldout", n)
    check = tasklib.TASKS["vowel"].check

    def eval_py(*args) -> float:
        result = run_main(eval_script.main, [f"--out_dir={chat_run / 'sft'}", "--task=vowel", f"--task_examples={n}",
                                             "--device=cpu", "--dtype=float32", *args])
        assert result.returncode == 0, result.stderr
        line = result.stdout
        return float(line.split("exact match ")[1].split()[0]) if "greedy" in line else \
            float(line.split("mean reward ")[1].split()[0])

    greedy, sampled = eval_py(), eval_py("--temperature=1")
    model, tok, _ = resolver.load_model(str(chat_run / "sft"), str(chat_run / "sft"))
    template = ChatTemplate.for_tokenizer(tok)
    with one_thread():
        mine = [reply_text(template, sample_replies(model.eval(), template, [template.render_prompt(tasklib.messages(p))],
                                                    1, 32, generators=[sampler(0, i)])[0][0])
                for i, p in enumerate(problems)]
    with running(tmp_path, f"--out_dir={chat_run / 'sft'}", "--model_name=tasks") as server:
        client = server.client()

        def ask(p, **kw) -> str:
            return client.chat.completions.create(model="tasks", messages=tasklib.messages(p), max_tokens=32,
                                                  **kw).choices[0].message.content

        served_greedy = [ask(p, temperature=0) for p in problems]
        served = [ask(p, temperature=1, seed=sample_seed(0, i)) for i, p in enumerate(problems)]
    assert sum(check(p, r) for p, r in zip(problems, served_greedy)) / n == greedy
    assert served == mine
    assert sum(check(p, r) for p, r in zip(problems, served)) / n == pytest.approx(sampled, abs=1e-4)
    assert 0 < sampled < 1  # neither all nor none: agreement that means something


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rl_on_cuda_learns_resumes_and_scores(chat_run, tmp_path, dtype):
    """On CUDA: the replies are drawn with CUDA generators and the step runs under autocast; the known optimum is
    still reached, a resume draws the replies of the run it continues, and eval.py scores the result."""
    cuda = dict(device="cuda", dtype=dtype)
    run_rl(chat_run, tmp_path / "whole", max_iters=30, **cuda)
    assert heldout(tmp_path / "whole")[30] >= 0.9, heldout(tmp_path / "whole")
    run_rl(chat_run, tmp_path / "parts", max_iters=2, eval_interval=2, **cuda)
    run_rl(chat_run, tmp_path / "parts", init_from="resume", max_iters=4, eval_interval=2, **cuda)
    parts, whole = ([r["reward"] for r in steps(tmp_path / d)][:3] for d in ("parts", "whole"))
    assert parts[:2] == whole[:2]  # the same weights and generators: the same replies
    assert abs(parts[2] - whole[2]) <= 2 / 64  # after a step: CUDA's backward may sum in another order
    result = run_main(eval_script.main, [f"--out_dir={tmp_path / 'whole'}", "--task=letter", "--task_examples=20",
                                         "--device=cuda", f"--dtype={dtype}"])
    assert result.returncode == 0 and "letter heldout: exact match" in result.stdout, result.stderr
