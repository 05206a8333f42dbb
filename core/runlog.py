"""The run log: out_dir/log.jsonl, one JSON record per logged iteration and per eval, and the same
records on Weights & Biases when wandb_log=True. Every rank calls `write(record)`; rank 0 writes, and
a failure (a full disk) stops every rank with the same one line.

    log = RunLog(out_dir / "log.jsonl", rt, resume_iter=None, wandb_config=None)
    log.write({"iter": 10, "loss": 2.31, "lr": 6e-4, "ms": 41.2, "tok_per_s": 18650.0, "mfu": None})
"""
import json
import math
from pathlib import Path

from core.errors import UserError
from core.fileio import atomic_path
from core.runtime import Runtime

# log.jsonl's keys and wandb's names for them; hellaswag_acc becomes hellaswag/acc, and so on.
WANDB_NAMES = {"iter": "iter", "train_loss": "train/loss", "val_loss": "val/loss", "loss": "train/loss_step",
               "lr": "lr", "mfu": "mfu"}


class RunLog:
    def __init__(self, path: Path, rt: Runtime, resume_iter: int | None, wandb_config: dict | None = None):
        """A fresh log (resume_iter None), or the log of the run being resumed at resume_iter.
        wandb_config (the run's config, with wandb_project and wandb_run_name) also starts a wandb run."""
        self.path, self.rt, self.wandb = path, rt, None
        rt.on_master(self._start, resume_iter, wandb_config)

    def write(self, record: dict) -> None:
        self.rt.on_master(self._append, record)

    def _start(self, resume_iter: int | None, wandb_config: dict | None) -> None:
        path = self.path
        if resume_iter is None:
            path.unlink(missing_ok=True)
        elif path.exists():
            # Keep only the iterations before the checkpoint: the resumed run redoes the rest, and
            # the log then reads as one run. A line cut short by a kill is dropped with them.
            kept = [line for line in path.read_text().splitlines() if _record_iter(line) < resume_iter]
            try:
                with atomic_path(path) as tmp:
                    tmp.write_text("".join(line + "\n" for line in kept))
            except OSError as e:
                raise self._error(e) from None
        self.wandb = _start_wandb(wandb_config) if wandb_config is not None else None

    def _append(self, record: dict) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # disk full: stop with one line, the last checkpoint is intact
            raise self._error(e) from None
        if self.wandb:
            self.wandb.log({WANDB_NAMES[k] if k in WANDB_NAMES else k.replace("_", "/", 1): v
                            for k, v in record.items() if k in WANDB_NAMES or k.startswith("hellaswag_")})

    def _error(self, e: OSError) -> UserError:
        return UserError(f"could not write {self.path}: {e.strerror or e}; the last checkpoint is intact")


def _record_iter(line: str) -> float:
    try:
        return json.loads(line)["iter"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def _start_wandb(config: dict):
    try:
        import wandb  # optional dependency, only when asked for
    except ImportError:
        raise UserError("wandb_log=True needs wandb: pip install wandb (or set --wandb_log=False)") from None
    return wandb.init(project=config["wandb_project"], name=config["wandb_run_name"], config=config)
