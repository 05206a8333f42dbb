"""The run directory: the config a run starts or resumes with, the file it records it in, the command that continues it.
"""
import json
import os
import shlex
from pathlib import Path

from core import config as configlib
from core.errors import UserError, first_line
from core.fileio import write_json
from core.runtime import Runtime
from core.weights import checkpoint


def auto_init_from(out_dir: str | os.PathLike) -> str:
    """init_from=auto: 'resume' when out_dir holds a checkpoint, else 'scratch': one command starts a run and
    continues it after a restart, requeue or preemption. The previous checkpoints count too: a kill between a
    sharded save's two renames leaves only ckpt.prev.dcp, and that run must continue, not start again over it."""
    names = (checkpoint.CKPT_NAME, checkpoint.PREV_NAME, checkpoint.SHARDED_NAME, checkpoint.PREV_SHARDED_NAME)
    return "resume" if any((Path(out_dir) / name).exists() for name in names) else "scratch"


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
        return configlib.parse_args(cls, argv, base=configlib.from_dict(cls, run, f"in {ckpt}"))
    try:
        run = json.loads(saved.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {saved} ({first_line(e)}); pass the run's config files again") from None
    if not isinstance(run, dict):
        raise UserError(f"{saved} is not a run's config (a JSON object); pass the run's config files again")
    run = {k: v for k, v in run.items() if k not in ("world_size", "device")}
    return configlib.parse_args(cls, argv, base=configlib.from_dict(cls, run, f"in {saved}"))


def write_run_config(cfg, out_dir: Path, rt: Runtime) -> None:
    """out_dir/config.json, the resolved config, once the run is about to train: a run stopped by a
    mistake (a missing dataset, a wrong setting) leaves no file behind."""
    def write() -> None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json(out_dir / "config.json", configlib.to_dict(cfg) | {"world_size": rt.world_size,
                                                                          "device": rt.device, "dtype": rt.dtype})
        except OSError as e:
            raise UserError(f"cannot write to out_dir '{out_dir}': {e.strerror}; choose a writable --out_dir") from None
    rt.on_master(write)


def resume_command(out_dir: Path, rt: Runtime, script: str = "train.py") -> str:
    """The command that continues this run, to paste as it is printed."""
    args = f"{script} --init_from=resume --out_dir={shlex.quote(str(out_dir))}"
    if not rt.distributed:
        return f"python {args}"
    if int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size)) != rt.world_size:  # several nodes
        return f"the same torchrun launch on each node, of {args}"
    return f"torchrun --standalone --nproc_per_node={rt.world_size} {args}"
