"""What train.py's and rl.py's loops share: the start-up around them (the config a run starts or resumes with, the
config.json it records), the optimizer step's tail, and the command that continues a stopped run.

    def main(argv): loop.start(TrainConfig, argv, train)     # the config, the runtime, train(cfg, rt, stop)
    stop_requested = loop.optimizer_step(model, optimizer, scaler, loss_sum, cfg, rt, stop, iter_num)
"""
import dataclasses
import json
import math
import os
import shlex
from pathlib import Path

import torch
import torch.distributed as dist

from core import config as configlib, runtime
from core.errors import UserError, alike_on_every_rank, first_line
from core.fileio import write_json
from core.training import memory
from core.weights import checkpoint, resolver


def start(cls: type, argv, train) -> None:
    """A training script's main: its config (a RunConfig subclass), the runtime, then train(cfg, rt, stop);
    running out of memory is one line, and the runtime is torn down however it ends."""
    # From the start: joining the process group, reading data and building the model can take minutes, and
    # under torchrun the SIGTERM it sends when another process fails must not cut this one's error short.
    stop = runtime.StopFlag(announce=runtime.dist_env()[0] == 0, message="stopping before training starts").install()
    with alike_on_every_rank():
        cfg = parse_config(cls, argv)
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.dist_timeout_s, cfg.threads, cfg.backend)
    try:
        train(cfg, rt, stop)
    except RuntimeError as e:  # torch.OutOfMemoryError included
        if not memory.is_out_of_memory(e):
            raise
        raise UserError(f"out of memory on {rt.device} (checkpoints already in {cfg.out_dir} are intact): "
                        f"{first_line(e, 160)}; use a smaller batch_size (with more gradient_accumulation_steps), "
                        f"block_size or model") from None
    finally:
        runtime.teardown(rt)


def parse_config(cls: type, argv):
    """cls's defaults (a resume's: the run's own config.json), then config files, then --key=value; keys a checkpoint
    cannot take, such as another n_layer, are refused when it loads."""
    cfg = configlib.parse_args(cls, argv, validate=False)
    init_from = cfg.init_from
    if init_from == "auto" and cls.starts_from_scratch:  # decided here, once: resume or scratch from now on
        init_from = auto_init_from(cfg.out_dir)
        argv = [*argv, f"--init_from={init_from}"]
    if resolver.kind_of(init_from) != "resume":
        return configlib.parse_args(cls, argv)
    return resumed_config(cls, argv, cfg.out_dir)


def auto_init_from(out_dir: str | os.PathLike) -> str:
    """init_from=auto: 'resume' when out_dir holds a checkpoint, else 'scratch': one command starts a run and
    continues it after a restart, requeue or preemption. The previous checkpoints count too: a kill between a
    sharded save's two renames leaves only ckpt.prev.dcp, and that run must continue, not start again over it."""
    return "resume" if checkpoint.find_checkpoint(out_dir, prev=True) else "scratch"


def resumed_config(cls: type, argv, out_dir: str | os.PathLike):
    """out_dir/config.json (the run's own) in place of cls's defaults, then argv, so `--init_from=resume
    --out_dir=RUN` is the whole command. The device and process count are resolved again; the dtype is kept, so a
    resume continues in the precision it trained in. No config.json: the config a nanoGPT ckpt.pt holds."""
    saved = Path(out_dir) / "config.json"
    if not saved.is_file():  # a nanoGPT run: the config its ckpt.pt holds; none to read: the resume says why
        ckpt = Path(out_dir) / checkpoint.CKPT_NAME
        try:
            run = checkpoint.load_checkpoint(ckpt)["meta"]["config"]
        except UserError:
            return configlib.parse_args(cls, argv, base=None)
        return configlib.parse_args(cls, argv, base=configlib.apply_overrides(cls(), run, f"in {ckpt}"))
    try:
        run = json.loads(saved.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {saved} ({first_line(e)}); pass the run's config files again") from None
    if not isinstance(run, dict):
        raise UserError(f"{saved} is not a run's config (a JSON object); pass the run's config files again")
    run = {k: v for k, v in run.items() if k not in ("world_size", "device")}
    return configlib.parse_args(cls, argv, base=configlib.apply_overrides(cls(), run, f"in {saved}"))


def write_run_config(cfg, out_dir: Path, rt: runtime.Runtime) -> None:
    """out_dir/config.json, the resolved config, once the run is about to train: a run stopped by a
    mistake (a missing dataset, a wrong setting) leaves no file behind."""
    def write() -> None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json(out_dir / "config.json", dataclasses.asdict(cfg) | {"world_size": rt.world_size,
                                                                          "device": rt.device, "dtype": rt.dtype})
        except OSError as e:
            raise UserError(f"cannot write to out_dir '{out_dir}': {e.strerror}; choose a writable --out_dir") from None
    rt.on_master(write)


def resume_command(out_dir: Path, rt: runtime.Runtime, script: str = "train.py") -> str:
    """The command that continues this run, to paste as it is printed."""
    args = f"{script} --init_from=resume --out_dir={shlex.quote(str(out_dir))}"
    if not rt.distributed:
        return f"python {args}"
    if int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size)) != rt.world_size:  # several nodes
        return f"the same torchrun launch on each node, of {args}"
    return f"torchrun --standalone --nproc_per_node={rt.world_size} {args}"


def optimizer_step(model, optimizer, scaler, loss_sum: torch.Tensor, cfg, rt: runtime.Runtime,
                   stop: runtime.StopFlag, iter_num: int) -> bool:
    """The step's tail, once every micro-step's backward is done: the guard, clip, step, zero the gradients.
    loss_sum: this process's loss (a tensor on the device). Returns whether a stop was asked for on any rank."""
    # The guard: the step's one host sync, since it must see this loss before the update. The stop flags travel
    # with it on a host-side group, so the device is not left waiting.
    stop_requested, any_bad = rt.any_rank(stop.requested, not math.isfinite(loss_sum.item()))
    if any_bad:
        raise UserError(f"loss is {global_mean(loss_sum, rt)} at iter {iter_num}; stopped before the optimizer step, "
                        f"the last checkpoint in {cfg.out_dir} is untouched. Lower learning_rate or check the data")
    if cfg.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return stop_requested


def global_sum(value: torch.Tensor | float, rt: runtime.Runtime) -> float:
    """value (a float, or a tensor on the device) summed over every rank in float64, then read on the host once."""
    if rt.distributed:
        value = torch.as_tensor(value, dtype=torch.float64, device=rt.device).clone()  # all_reduce works in place
        dist.all_reduce(value)
    return float(value)


def global_mean(loss_sum: torch.Tensor, rt: runtime.Runtime) -> float:
    """The mean of every rank's loss_sum (each already averaged over its micro-steps)."""
    return global_sum(loss_sum, rt) / rt.world_size
