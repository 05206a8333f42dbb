"""Reinforcement learning from a chat run, on tasks whose answers a program checks (core/data/tasks.py).

    python rl.py config/rl_tasks_char.py                                  # after docs/chat.md's SFT
    python rl.py config/rl_tasks_char.py --tasks=reverse --samples_per_prompt=16 --out_dir=out-rl-reverse
    python rl.py --init_from=resume --out_dir=out-rl-tasks-char           # continue a stopped run
    torchrun --standalone --nproc_per_node=2 rl.py config/rl_tasks_char.py   # each process its own prompts
    python eval.py --out_dir=out-rl-tasks-char --task=reverse              # held-out exact match

On-policy REINFORCE with the group's mean reward as baseline, as nanochat's chat_rl.py (GRPO without its ratio,
clipping or KL): a group all right or all wrong teaches nothing. The step and its choices: docs/chat.md. Config,
log.jsonl, checkpoints and signals are train.py's, so every script reads an RL run as any other; a resume continues
bit for bit, the prompts and replies drawn from (seed, iteration, prompt index) on any number of processes.
"""
from core.errors import UserError, alike_on_every_rank, quiet_start, run_cli
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import copy
import dataclasses
import math
import random
import time
from typing import Sequence

import torch
import torch.distributed as dist

from core import runtime
from core.data import tasks as tasklib
from core.data.chat import ChatTemplate
from core.data.tokenizer import tokenizer_from_meta
from core.decoding.replies import reply_text, sample_replies, sampler
from core.evaluation.answers import task_scores
from core.evaluation.perplexity import target_losses
from core.training import checkpointing, loop, optim, parallel, preflight
from core.training.runlog import RunLog, format_duration
from core.training.train_config import RunConfig
from core.weights import resolver
from model import GPT


@dataclasses.dataclass
class RLConfig(RunConfig):  # its keys: RunConfig's (those declared again here with rl.py's defaults), then these
    # I/O
    init_from: str = "out-sft-tasks-char"  # a chat run's out_dir (its weights, a new run), or 'resume' (out_dir's)
    out_dir: str = "out-rl"
    eval_interval: int = 25                # held-out exact match, then a checkpoint, every N iterations
    eval_examples: int = 100               # held-out problems per task at each eval, greedy
    # the tasks and the replies
    tasks: str = "reverse,upper"           # comma-separated tasks of core/data/tasks.py: reverse, upper, add, ...
    prompts_per_iter: int = 16             # problems per iteration, all processes together; the tasks take turns
    samples_per_prompt: int = 8            # replies per problem: the group whose mean reward is the baseline
    temperature: float = 1.0               # > 0: the replies to one prompt must differ to be compared
    top_k: int | None = None               # sample from the k most likely tokens only; None: all
    max_new_tokens: int = 16               # the longest reply; one cut here has no end token
    batch_size: int = 0                    # reply rows per forward and backward; 0: all of a process's at once
    # the objective
    update: str = "reinforce"              # reinforce: the policy gradient; rft: fine-tune on the accepted replies
    std_advantage: bool = False            # also divide each advantage by its group's reward std (GRPO)
    kl_coef: float = 0.0                   # weight of a KL penalty to the starting model on reply tokens; 0: none
    # AdamW, with a cosine schedule from learning_rate to min_lr at max_iters
    learning_rate: float = 1e-4
    min_lr: float = 1e-5                   # the learning rate at max_iters
    warmup_iters: int = 0
    max_iters: int = 200
    weight_decay: float = 0.0

    POSITIVE = RunConfig.POSITIVE + ("eval_examples", "prompts_per_iter", "max_new_tokens")
    NOT_NEGATIVE = RunConfig.NOT_NEGATIVE + ("batch_size", "kl_coef")
    starts_from_scratch = False

    def validate(self) -> None:
        super().validate()
        if self.samples_per_prompt < 2:
            raise UserError(f"samples_per_prompt must be at least 2: the baseline is the group's mean, so one reply "
                            f"has advantage 0 and teaches nothing; got {self.samples_per_prompt}")
        if not 0 < self.temperature < math.inf:
            raise UserError(f"temperature must be > 0: greedy replies to one prompt are all the same, and the same "
                            f"rewards teach nothing; got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be at least 1 (or None: no limit), got {self.top_k}")
        if self.update not in ("reinforce", "rft"):
            raise UserError(f"update must be reinforce or rft, got {self.update!r}")
        if self.update == "rft" and self.std_advantage:
            raise UserError("std_advantage divides REINFORCE's advantages; update=rft weighs each accepted reply 1")
        tasklib.task_names(self.tasks)


def main(argv: Sequence[str]) -> None:
    loop.start(RLConfig, argv, train)  # the config (loop.parse_config), the runtime, then train()


def train(cfg: RLConfig, rt: runtime.Runtime, stop: runtime.StopFlag) -> None:
    log = print if rt.is_master else (lambda *a, **k: None)
    starting = "before training started; nothing was written"
    stop.check(starting)
    with alike_on_every_rank():
        if cfg.prompts_per_iter % rt.world_size:
            raise UserError(f"prompts_per_iter ({cfg.prompts_per_iter}) must be divisible by the number of "
                            f"processes ({rt.world_size}); it counts prompts across all processes")
        out_dir = preflight.check_out_dir(cfg)
        w, policy, template, started_from = load_policy(cfg, log)
        names = tasklib.task_names(cfg.tasks)
        tasklib.check_vocabulary(names, template.tok.encode, f"the vocabulary of {w.source}")
    resuming = w.kind == "resume"
    raw_model = policy.to(rt.device)
    reference = None  # the KL term's: the starting model, frozen (a resume reloads it from the run it started from)
    if cfg.kl_coef:
        start = policy if w.kind != "resume" else resolver.load_model(started_from, started_from)[0]
        reference = copy.deepcopy(start).to(rt.device).eval().requires_grad_(False)
    model = parallel.parallelize(raw_model, rt, "ddp", activation_checkpointing=False, compile=False)
    optimizer = optim.build_optimizer(raw_model, "adamw", cfg.learning_rate, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                                      rt.device_type)
    scaler = rt.grad_scaler()
    iter_num = checkpointing.restore(w, raw_model, optimizer, scaler, rt, log)[0] if resuming else 0
    tok_meta = w.tokenizer_meta
    del w
    stop.check(starting)
    loop.write_run_config(cfg, out_dir, rt)  # the run starts: nothing was written before this point
    log(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | {rt.world_size} process(es) on {rt.device} in "
        f"{rt.dtype} | tasks {', '.join(names)} | {cfg.prompts_per_iter} prompts x {cfg.samples_per_prompt} replies "
        f"per iteration")
    runlog = RunLog(out_dir / "log.jsonl", rt, iter_num if resuming else None)
    heldout = {name: tasklib.problems(name, "heldout", cfg.eval_examples) for name in names}
    stop.message = "stopping after this iteration; saving"
    stop_requested, last_saved, steps_run, loop_start = False, iter_num if resuming else -1, 0, time.perf_counter()

    def save(reason: str) -> None:  # every rank calls it
        meta = {"iter_num": iter_num, "best_val_loss": float("inf"), "model_args": dataclasses.asdict(raw_model.config),
                "config": dataclasses.asdict(cfg), "tokenizer": tok_meta, "world_size": rt.world_size,
                "started_from": started_from}
        path = checkpointing.save(out_dir, meta, raw_model, optimizer, scaler, rt, sharded=False)
        log(f"saved checkpoint at iter {iter_num} to {path} ({reason})")

    def finish(how: str) -> None:
        log(f"{how} at iter {iter_num}/{cfg.max_iters} after {format_duration(runlog.elapsed())} (this launch: "
            f"{steps_run} iterations in {format_duration(time.perf_counter() - loop_start)})")

    while True:
        if stop_requested:
            save(f"stopped by {stop.signal_name or 'a signal to another process'}")
            finish("stopped")
            log(f"stopped at iter {iter_num}; continue with: {loop.resume_command(out_dir, rt, 'rl.py')}")
            return
        if iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters:  # held-out exact match, greedy
            scores = {}
            for name in names:
                r = task_scores(raw_model, template, name, heldout[name], max_new_tokens=cfg.max_new_tokens,
                                device=rt.device, autocast=rt.autocast, rank=rt.rank,
                                world_size=rt.world_size, stopped=lambda: rt.any_rank(stop.requested)[0])
                if r is None:  # a signal during the eval: save the last completed step, unevaluated
                    stop_requested = True
                    break
                scores[f"heldout_{name}"] = r["mean"]
            if stop_requested:
                continue
            log(f"step {iter_num}: held-out exact match "
                + ", ".join(f"{k.removeprefix('heldout_')} {v:.4f}" for k, v in scores.items()))
            runlog.write({"iter": iter_num} | scores)
            if iter_num > max(last_saved, 0):
                save("end of training" if iter_num >= cfg.max_iters else "scheduled")
                last_saved = iter_num
        if iter_num >= cfg.max_iters:
            finish("done")
            return
        lr = optim.lr_at(iter_num, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.max_iters)
        optim.set_lr(optimizer, lr / cfg.learning_rate)
        t0 = time.perf_counter()

        # 1. replies: this process's prompts, samples_per_prompt replies to each in one batched decode, each prompt's
        # drawn with its own generator, scored by their task's checker
        raw_model.eval()
        mine = range(rt.rank, cfg.prompts_per_iter, rt.world_size)
        problems = [problem_at(cfg.seed, iter_num, j, names) for j in mine]
        prompts = [template.render_prompt(tasklib.messages(problem)) for _, problem in problems]
        with rt.autocast():
            replies = sample_replies(raw_model, template, prompts, cfg.samples_per_prompt, cfg.max_new_tokens,
                                     cfg.temperature, cfg.top_k, [sampler(cfg.seed, iter_num, j, device=rt.device)
                                                                  for j in mine])
        rows = [(prompt, reply) for prompt, group in zip(prompts, replies) for reply in group]
        rewards = torch.tensor([[tasklib.TASKS[name].check(problem, reply_text(template, r)) for r in group]
                                for (name, problem), group in zip(problems, replies)], device=rt.device)  # (P, S)
        # 2. each reply's weight: its advantage against its group (reinforce), or 1 if accepted (rft)
        weights = reply_weights(rewards, cfg.update, cfg.std_advantage).flatten()  # (rows,)
        x, y = pack(rows, rt.device)  # (rows, T): prompt and reply in, the reply's ids as targets, -1 elsewhere
        counted = y[weights != 0] if cfg.update == "rft" else y  # rft: only the accepted replies' tokens count
        n_tokens = max(1.0, loop.global_sum((counted >= 0).sum(), rt))  # every process's: each token weighs the same
        # the iteration's forward and backward tokens: each row's (x's) through the sampling's forward, the step's
        # forward and backward, and the KL term's forward
        tokens = loop.global_sum((3 + (reference is not None)) * float(sum(len(p) + len(r) - 1 for p, r in rows)), rt)

        # 3. the step: the policy gradient over every reply token, in chunks of batch_size rows
        raw_model.train()
        chunk = cfg.batch_size or x.size(0)
        loss_sum, kl_sum = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
        for start in range(0, x.size(0), chunk):
            xs, ys, adv = x[start:start + chunk], y[start:start + chunk], weights[start:start + chunk]
            with parallel.micro_step(model, rt, "ddp", last=start + chunk >= x.size(0)):
                with rt.autocast():
                    logits = model(xs)[0]  # (rows, T, vocab)
                logp = -target_losses(logits, ys)  # (rows, T) log-probabilities, 0 off the reply
                # The sum over processes' reply tokens / n_tokens; DDP averages gradients, hence x world_size.
                loss = -(adv[:, None] * logp).sum() / n_tokens * rt.world_size
                if reference is not None:  # k3 estimator of KL(policy || reference) per reply token (Schulman)
                    with torch.no_grad(), rt.autocast():
                        ref_logp = -target_losses(reference(xs)[0], ys)
                    delta = (ref_logp - logp) * (ys >= 0)
                    kl = (delta.exp() - delta - 1).sum() / n_tokens * rt.world_size
                    loss = loss + cfg.kl_coef * kl
                    kl_sum += kl.detach()
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # the guard (a non-finite loss stops the run before the update), clip, step, zero the gradients
        stop_requested = loop.optimizer_step(model, optimizer, scaler, loss_sum, cfg, rt, stop, iter_num)
        dt = time.perf_counter() - t0
        iter_num += 1
        steps_run += 1

        if (iter_num - 1) % cfg.log_interval == 0:
            lengths = torch.tensor([len(reply) for _, reply in rows], dtype=torch.float64)
            stats = sample_stats(rewards, lengths, loss_sum, kl_sum, rt)
            log(f"iter {iter_num - 1}/{cfg.max_iters}: reward {stats['reward']:.4f} (max {stats['reward_max']:.2f}), "
                f"exact {stats['exact']:.4f}, reply {stats['reply_tokens']:.1f} tokens, loss {stats['loss']:.4f}"
                + (f", kl {stats['kl']:.5f}" if reference is not None else "")
                + f", lr {lr:.2e}, time {dt * 1000:.0f}ms")
            runlog.write({"iter": iter_num - 1, "lr": lr, "ms": dt * 1000, "tokens": tokens}
                         | {k: v for k, v in stats.items() if k != "kl" or reference is not None})


# -----------------------------------------------------------------------------
# what train() calls, in the order it calls it


def load_policy(cfg: RLConfig, log) -> tuple[resolver.Weights, GPT, ChatTemplate, str]:
    """What init_from names (a chat run, or this run's checkpoint), the policy built from it with dropout off (the
    step raises the log-probabilities the replies were sampled with), its chat template, and the run it started from."""
    w = resolver.locate(cfg.init_from, cfg.out_dir, {"dropout": 0.0}, training=True, log=log)
    if w.kind == "resume":
        log(f"resuming from {w.path} at iter {w.state['meta']['iter_num']}")
    meta = w.tokenizer_meta or w.tokenizer.meta()
    template = ChatTemplate.for_tokenizer(tokenizer_from_meta(meta, source=w.source))
    if template is None:
        raise UserError(f"{w.source} has no chat tokens (a base model): fine-tune it on conversations first "
                        f"(docs/chat.md), then start rl.py from that run")
    w.tokenizer_meta = meta
    started_from = w.state["meta"].get("started_from", cfg.init_from) if w.kind == "resume" else cfg.init_from
    return w, resolver.build(w), template, started_from


def problem_at(seed: int, it: int, index: int, names: list[str]) -> tuple[str, tasklib.Problem]:
    """Prompt `index` of iteration `it`: the tasks take turns, each problem drawn from its train side with a
    generator of its own, so the same on any number of processes and after a resume."""
    name = names[index % len(names)]
    return name, tasklib.draw(name, "train", random.Random(f"{seed}:{it}:{index}"))


def reply_weights(rewards: torch.Tensor, update: str, by_std: bool) -> torch.Tensor:
    """rewards (prompts, samples) -> each reply's weight in the loss: reinforce's advantage (by_std: over the group's
    std; equal rewards stay 0), or rft's 1 for an accepted reply, else 0 (the rejected kept in the batch: same cost)."""
    if update == "rft":
        return (rewards == 1.0).to(rewards.dtype)
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if by_std:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + 1e-6)
    return advantages


def pack(rows: list[tuple[list[int], list[int]]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids, reply ids) pairs -> inputs x (N, T), prompt + reply without its last id, and targets y (N, T),
    the next id where it is the reply's, else -1 (the prompt and the right padding are never targets)."""
    T = max(len(prompt) + len(reply) for prompt, reply in rows) - 1
    x = torch.zeros(len(rows), T, dtype=torch.long)
    y = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, (prompt, reply) in enumerate(rows):
        seq = prompt + reply
        x[i, :len(seq) - 1] = torch.tensor(seq[:-1])
        y[i, len(prompt) - 1:len(seq) - 1] = torch.tensor(reply)
    return x.to(device), y.to(device)


def sample_stats(rewards: torch.Tensor, lengths: torch.Tensor, loss: torch.Tensor, kl: torch.Tensor,
                 rt: runtime.Runtime) -> dict[str, float]:
    """The iteration's record over every process's replies: reward mean and max, the exact rate (reward 1), the
    mean reply length in tokens (its end token included), the loss and the KL term."""
    r = rewards.double().cpu().flatten()
    sums = torch.tensor([r.sum(), (r == 1.0).sum(), lengths.sum(), r.numel(), loss.item(), kl.item()],
                        dtype=torch.float64)
    top = r.max().reshape(1)
    if rt.distributed:
        sums, top = sums.to(rt.device), top.to(rt.device)
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    total, exact, tokens, n, loss_total, kl_total = sums.tolist()
    # Each process's loss is its share times world_size (DDP averages): their sum is world_size x the loss.
    return {"reward": total / n, "reward_max": top.item(), "exact": exact / n, "reply_tokens": tokens / n,
            "loss": loss_total / rt.world_size, "kl": kl_total / rt.world_size}


if __name__ == "__main__":
    run_cli(main)
