"""The run log: out_dir/log.jsonl, one JSON record per logged iteration and per eval (and on Weights & Biases with
wandb_log). Every rank calls `write(record)`; rank 0 writes, and a failure (a full disk) stops every rank with the
same one line. Each record gets `time` and `elapsed_s`, counted on across a resume (the pause left out).
"""
import json
import math
import time
from pathlib import Path

from core.errors import UserError, is_disk_full
from core.fileio import atomic_path, disk_full_error
from core.runtime import Runtime
from core.training.checkpointing import last_intact

# log.jsonl's keys and wandb's names for them; hellaswag_acc becomes hellaswag/acc, and so on.
WANDB_NAMES = {"iter": "iter", "train_loss": "train/loss", "val_loss": "val/loss", "loss": "train/loss_step",
               "lr": "lr", "mfu": "mfu"}


class RunLog:
    def __init__(self, path: Path, rt: Runtime, resume_iter: int | None, wandb_config: dict | None = None):
        """A fresh log (resume_iter None), or the log of the run being resumed at resume_iter; wandb_config (the
        run's config) also starts a wandb run."""
        self.path, self.rt, self.wandb = path, rt, None
        self.started, self.elapsed_before = time.monotonic(), 0.0
        rt.on_master(self._start, resume_iter, wandb_config)

    def elapsed(self) -> float:
        """Seconds of this run so far, its earlier launches' included (see the module docstring)."""
        return self.elapsed_before + time.monotonic() - self.started

    def write(self, record: dict) -> None:
        record = record | {"time": round(time.time(), 3), "elapsed_s": round(self.elapsed(), 3)}
        self.rt.on_master(self._append, record)

    def _start(self, resume_iter: int | None, wandb_config: dict | None) -> None:
        path = self.path
        if resume_iter is None:
            path.unlink(missing_ok=True)
        elif path.exists():
            # Keep only the iterations before the checkpoint: the resumed run redoes the rest, and
            # the log then reads as one run. A line cut short by a kill is dropped with them.
            kept = [(line, r) for line in path.read_text().splitlines()
                    if (r := _record(line)).get("iter", math.inf) < resume_iter]
            elapsed = [r.get("elapsed_s") for _, r in kept]  # logs written before timestamps have none
            self.elapsed_before = max((float(e) for e in elapsed if isinstance(e, (int, float))), default=0.0)
            text = "".join(line + "\n" for line, _ in kept)
            try:
                with atomic_path(path) as tmp:
                    tmp.write_text(text)
            except OSError as e:
                raise self._error(e, len(text.encode())) from None
        if wandb_config is not None:
            try:
                import wandb  # optional dependency, only when asked for
            except ImportError:
                raise UserError("wandb_log=True needs wandb: pip install wandb (or set --wandb_log=False)") from None
            self.wandb = wandb.init(project=wandb_config["wandb_project"], name=wandb_config["wandb_run_name"],
                                    config=wandb_config)

    def _append(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        try:
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as e:  # disk full: stop with one line, the last checkpoint is intact
            raise self._error(e, len(line.encode())) from None
        if self.wandb:
            self.wandb.log({WANDB_NAMES[k] if k in WANDB_NAMES else k.replace("_", "/", 1): v
                            for k, v in record.items() if k in WANDB_NAMES or k.startswith("hellaswag_")})

    def _error(self, e: OSError, needed: int | None = None) -> UserError:
        if is_disk_full(e):
            return disk_full_error(self.path, needed, last_intact(self.path.parent))
        return UserError(f"could not write {self.path}: {e.strerror or e}; {last_intact(self.path.parent)}")


def format_duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m': a duration as a person reads it in a progress line."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _record(line: str) -> dict:
    """A line's record; {} for a line cut short by a kill, or anything else but a record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return {}
    return record if isinstance(record, dict) else {}
