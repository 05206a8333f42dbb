"""The speedrun's race: runs that take turns of a few iterations each until every one reaches a target
val loss or its cap, timed on two clocks with evaluation time kept apart.

Pure scheduling: a Racer is given its step, evaluation and device sync as functions, and the clocks
are passed in, so that a test can script them.
"""
import dataclasses
import time
from typing import Callable


@dataclasses.dataclass
class Racer:
    """One run of the race: step(it) trains iteration it, evaluate() returns the whole-val-split loss,
    tokens_at(it) is how many tokens iteration it trains, sync() waits for the device, log(record) keeps an
    evaluation. The rest is its record so far."""
    name: str
    step: Callable[[int], None]
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
    stopped: bool = False  # at the cap without reaching the target
    chunks: list = dataclasses.field(default_factory=list)  # (round, first iter, iter after the last)

    @property
    def done(self) -> bool:
        return self.reached is not None or self.stopped


def eval_due(it: int, curve: list, target: float, every: int, fine_every: int, margin: float) -> bool:
    """Evaluate at every `every`-th iteration, and at every `fine_every`-th once near the target: the last
    evaluation within `margin` of it, or the line through the last two reaching it before the next coarse
    one (from the second evaluation after the start on). Dense where the crossing is, cheap elsewhere."""
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


def run_chunk(r: Racer, n: int, target: float, every: int, fine_every: int, margin: float,
              clocks: tuple[Callable[[], float], Callable[[], float]]) -> None:
    """Up to n iterations of r, evaluating where due; r is done at the first evaluation at or below the
    target, or at its cap.

    Only iterations are timed, on both clocks (wall, and this process's CPU time): a stretch of iterations
    is closed with sync() before the clocks are read, and an evaluation's own time goes to eval_wall_s."""
    wall, cpu = clocks

    def close_stretch() -> None:
        r.sync()
        w, c = wall(), cpu()
        r.train_wall_s += w - start[0]
        r.train_cpu_s += c - start[1]
        start[:] = [w, c]

    start, trained = [wall(), cpu()], 0
    while True:
        fresh = not r.curve or r.curve[-1][0] != r.it  # not evaluated yet at this iteration
        if fresh and (eval_due(r.it, r.curve, target, every, fine_every, margin) or r.it == r.max_iters):
            close_stretch()
            loss = r.evaluate()
            w = wall()
            r.eval_wall_s += w - start[0]
            start[:] = [w, cpu()]
            r.curve.append([r.it, loss, r.train_wall_s, r.train_cpu_s])
            r.log({"iter": r.it, "val_loss": loss, "train_s": r.train_wall_s, "train_cpu_s": r.train_cpu_s})
            if loss <= target:
                r.reached = {"iter": r.it, "tokens": r.tokens, "wall_s": r.train_wall_s,
                             "cpu_s": r.train_cpu_s, "val_loss": loss}
                return
        if r.it >= r.max_iters:
            r.stopped = True
            return
        if trained == n:
            break
        r.step(r.it)
        r.tokens += r.tokens_at(r.it)
        r.it += 1
        trained += 1
    close_stretch()


def race(racers: list[Racer], chunk: int, target: float, every: int, fine_every: int, margin: float,
         clocks=(time.perf_counter, time.process_time), progress: Callable[[Racer], None] = lambda r: None) -> None:
    """Alternate chunks of `chunk` iterations between the runs until each reaches target or its cap,
    so that whatever else loads the machine meanwhile hits all of them alike."""
    number = 0
    while not all(r.done for r in racers):
        for r in racers:
            if not r.done:
                first = r.it
                run_chunk(r, chunk, target, every, fine_every, margin, clocks)
                r.chunks.append((number, first, r.it))
                progress(r)
        number += 1
