"""RunConfig, the keys train.py and rl.py share, and TrainConfig, train.py's (core/config.py parses them); here,
not in train.py, since bench.py and scripts/compare_recipe.py read the same config files.
"""
import dataclasses
import math

from core import runtime
from core.config import at_least, field_help
from core.errors import UserError
from core.training import optim, parallel
from core.weights import resolver
from model import CHOICES, GPTConfig

# The model keys are GPTConfig's fields, each with GPTConfig's default, except vocab_size: None there
# is the dataset's meta.json vocab_size. A field added to GPTConfig is a key here with nothing to edit.
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(GPTConfig))
# The keys a resumed run must share with its checkpoint: all but how the model runs (block_size may shrink).
ARCHITECTURE_KEYS = tuple(k for k in MODEL_KEYS if k not in ("block_size", "dropout", "attn_backend"))


@dataclasses.dataclass
class RunConfig:
    """The keys of every training loop, with train.py's defaults: a loop's config extends it and declares again
    only the keys whose default (or meaning) is its own."""
    # I/O
    init_from: str = "scratch"            # 'scratch', 'resume', 'auto' (resume if out_dir holds a checkpoint, else
                                          # scratch), a base run's out_dir (its weights, a new run),
                                          # a GPT-2 name, or a transformers folder (docs/interop.md)
    out_dir: str = "out"                   # checkpoints, config.json and log.jsonl
    overwrite: bool = False               # a new run may replace the checkpoint out_dir already holds
    eval_interval: int = 2000              # estimate train and val loss (and save) every N iterations
    log_interval: int = 1                  # print and log every N iterations
    # AdamW
    learning_rate: float = 6e-4            # AdamW's peak learning rate
    max_iters: int = 600000                # iterations in all; a resumed run stops here too
    weight_decay: float = 0.1              # AdamW's, on matrices and embeddings only
    beta1: float = 0.9                     # AdamW's first-moment decay
    beta2: float = 0.95                    # AdamW's second-moment decay
    grad_clip: float = 1.0                 # 0 disables clipping
    warmup_iters: int = 2000               # linear warmup from 0 over N iterations
    min_lr: float = 6e-5                   # the learning rate at and after lr_decay_iters
    # system
    device: str = "auto"                   # auto, cpu, cuda, cuda:N, mps
    dtype: str = "auto"                    # auto, float32, bfloat16, float16
    threads: int = 0                       # torch's CPU threads; 0: torch's default, one per core (docs/performance.md)
    seed: int = 1337                       # weights, dropout, batches and rl.py's replies all follow from it
    dist_timeout_s: float = 600.0          # a dead peer ends the job after this, never a hang
    backend: str = "auto"                  # torchrun's process group: auto (nccl on CUDA, else gloo) | nccl | gloo

    # Not keys: the keys that count (at least 1) and those never negative, a loop's own added; and whether
    # init_from may be 'scratch' and 'auto' (rl.py starts from a chat run).
    POSITIVE = ("eval_interval", "log_interval", "max_iters")
    NOT_NEGATIVE = ("warmup_iters", "weight_decay", "grad_clip")
    starts_from_scratch = True

    def validate(self) -> None:
        at_least(self, 1, *self.POSITIVE)
        at_least(self, 0, *self.NOT_NEGATIVE)
        if not 0 < self.learning_rate < math.inf:
            raise UserError(f"need 0 < learning_rate < inf, got {self.learning_rate}")
        # min_lr is where the decay ends; train.py's decay_lr=False keeps the rate at learning_rate throughout.
        if getattr(self, "decay_lr", True) and not 0 <= self.min_lr <= self.learning_rate:
            raise UserError(f"need 0 <= min_lr <= learning_rate, got min_lr={self.min_lr}, "
                            f"learning_rate={self.learning_rate}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise UserError(f"need 0 <= beta1, beta2 < 1, got {self.beta1}, {self.beta2}")
        if not self.dist_timeout_s > 0:
            raise UserError(f"dist_timeout_s must be positive, got {self.dist_timeout_s}")
        if self.backend not in runtime.BACKENDS:
            raise UserError(f"backend must be one of {', '.join(runtime.BACKENDS)}, got '{self.backend}'")
        resolver.check_init_from(self.init_from, scratch=self.starts_from_scratch)


# GPTConfig's fields as TrainConfig's model keys, their --help text and allowed values from its comments and CHOICES.
_HELP = field_help(GPTConfig) | {"vocab_size": "None: the dataset's meta.json vocab_size"}
ModelKeys = dataclasses.make_dataclass("ModelKeys", [
    (f.name, int | None if f.name == "vocab_size" else f.type,
     dataclasses.field(default=None if f.name == "vocab_size" else f.default,
                       metadata={"help": _HELP.get(f.name, ""), "choices": CHOICES.get(f.name)}))
    for f in dataclasses.fields(GPTConfig)])


@dataclasses.dataclass
class TrainConfig(RunConfig, ModelKeys):  # its keys: ModelKeys', then RunConfig's, then these
    # I/O
    eval_iters: int = 200                  # batches per split in each eval
    eval_only: bool = False                # evaluate once and exit, saving nothing
    hellaswag_file: str | None = None     # also score HellaSwag at each eval (data/hellaswag/prepare.py)
    always_save_checkpoint: bool = True   # at each eval; False keeps only val-loss improvements
    checkpoint_interval: int = 0          # also save every N iterations (0: only at evals and the end)
    # logging
    wandb_log: bool = False                # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "nanogpt"         # wandb's project
    wandb_run_name: str = "run"            # wandb's run name
    # data
    data_dir: str = "data/fineweb"         # a folder prepare.py wrote: train.bin, val.bin, meta.json
    gradient_accumulation_steps: int = 40  # global: across all processes together
    batch_size: int = 12                   # micro-batch per process
    loss_mask: bool = True                 # chat datasets: learn only the assistant's tokens; False: every token
    # the optimizer (AdamW's keys are RunConfig's)
    optimizer: str = "adamw"               # adamw | muon (Muon for hidden matrices, AdamW for the rest)
    muon_lr: float = 0.02                  # Muon's peak lr; learning_rate stays AdamW's, the schedule scales both
    muon_momentum: float = 0.95            # Muon's Nesterov momentum
    muon_weight_decay: float = 0.0         # Muon's decoupled weight decay
    muon_ns_steps: int = 5                 # Newton-Schulz iterations per Muon update (torch's default)
    muon_ns_coefficients: str = "quintic"  # quintic (torch's, one polynomial) | polar_express (one per step, <= 5)
    # learning-rate schedule: linear warmup, then down to min_lr at lr_decay_iters (core/training/optim.py lr_at)
    decay_lr: bool = True                  # False: learning_rate throughout, no warmup or decay
    lr_schedule: str = "cosine"            # cosine (nanoGPT) | wsd: the peak, then linear over the last cooldown_frac
    cooldown_frac: float = 0.2             # wsd only: the fraction of lr_decay_iters spent decaying
    lr_decay_iters: int = 600000           # where the decay reaches min_lr (usually max_iters)
    # sequence-length warm-up (seq_len_at): short windows first, for cheaper early iterations
    seq_len_warmup_iters: int = 0          # grow the window to block_size over N iterations; 0: block_size throughout
    seq_len_warmup_start: int = 16         # the first window's length; the length grows in multiples of it
    # system
    compile: bool | None = None            # None: on for CUDA, off elsewhere
    parallel: str = "ddp"                  # ddp: full copies per process; fsdp: sharded (core/training/parallel.py)
    activation_checkpointing: bool = False  # recompute each Block in the backward pass: less memory, more compute

    # nanoGPT's name for a key (docs/from-nanogpt.md): dataset=X is its data/X folder
    RENAMED = {"dataset": ("data_dir", lambda name: f"data/{name}")}
    POSITIVE = RunConfig.POSITIVE + ("eval_iters", "gradient_accumulation_steps", "batch_size", "block_size",
                                     "n_layer", "n_head", "n_embd", "lr_decay_iters")
    NOT_NEGATIVE = RunConfig.NOT_NEGATIVE + ("checkpoint_interval",)

    def model_args(self) -> dict:
        """The GPTConfig fields this config sets; vocab_size comes from the dataset (or the checkpoint)."""
        return {k: getattr(self, k) for k in MODEL_KEYS if k != "vocab_size"}

    def validate(self) -> None:
        super().validate()
        try:  # the model keys and their combinations: GPTConfig is their one judge
            GPTConfig(**self.model_args())
        except ValueError as e:
            raise UserError(str(e)) from None
        if self.optimizer not in optim.OPTIMIZERS:
            raise UserError(f"optimizer must be one of {', '.join(optim.OPTIMIZERS)}, got '{self.optimizer}'")
        if not (self.muon_lr > 0 and 0 <= self.muon_momentum < 1 and self.muon_weight_decay >= 0):
            raise UserError(f"need muon_lr > 0, 0 <= muon_momentum < 1, muon_weight_decay >= 0, got {self.muon_lr}, "
                            f"{self.muon_momentum}, {self.muon_weight_decay}")
        if self.lr_schedule not in optim.SCHEDULES or not 0 < self.cooldown_frac <= 1:
            raise UserError(f"lr_schedule must be one of {', '.join(optim.SCHEDULES)} and 0 < cooldown_frac <= 1, "
                            f"got '{self.lr_schedule}', {self.cooldown_frac}")
        if not 1 <= self.muon_ns_steps < 100:
            raise UserError(f"muon_ns_steps must be in [1, 99], got {self.muon_ns_steps}")
        if self.muon_ns_coefficients not in optim.NS_COEFFICIENTS:
            raise UserError(f"muon_ns_coefficients must be one of {', '.join(optim.NS_COEFFICIENTS)}, got "
                            f"'{self.muon_ns_coefficients}'")
        if self.muon_ns_coefficients != "quintic":
            optim.ns_schedule(self.muon_ns_coefficients, self.muon_ns_steps)  # its steps are counted
        if self.seq_len_warmup_iters < 0 or (self.seq_len_warmup_iters
                                             and not 1 <= self.seq_len_warmup_start < self.block_size):
            raise UserError(f"need seq_len_warmup_iters >= 0, and 1 <= seq_len_warmup_start < block_size "
                            f"({self.block_size}) when it is on, got {self.seq_len_warmup_iters}, "
                            f"{self.seq_len_warmup_start}")
        parallel.check_parallel(self.parallel, self.dtype)


def get_lr(it: int, cfg: TrainConfig) -> float:
    if not cfg.decay_lr:
        return cfg.learning_rate
    return optim.lr_at(it, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters, cfg.lr_schedule,
                       cfg.cooldown_frac)


def seq_len_at(it: int, cfg: TrainConfig) -> int:
    """The training window's length at iteration it (docs/recipe.md, seq_len_warmup_iters): a function of it alone,
    in integers, so every rank and resumed run agrees on it."""
    if it >= cfg.seq_len_warmup_iters:
        return cfg.block_size
    start = cfg.seq_len_warmup_start
    grown = start + (cfg.block_size - start) * it // cfg.seq_len_warmup_iters
    return grown // start * start


def local_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    if cfg.gradient_accumulation_steps % world_size:
        raise UserError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be divisible by the "
                        f"number of processes ({world_size}); it counts micro-steps across all processes")
    return cfg.gradient_accumulation_steps // world_size


def make_optimizer(model, cfg: TrainConfig, device_type: str):
    return optim.build_optimizer(model, cfg.optimizer, cfg.learning_rate, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                                 device_type, cfg.muon_lr, cfg.muon_momentum, cfg.muon_weight_decay,
                                 cfg.muon_ns_steps, cfg.muon_ns_coefficients)
