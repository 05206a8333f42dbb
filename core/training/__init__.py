"""The training wing: what a run (train.py's, rl.py's) adds to a model and a dataset.

train_config.py (RunConfig, the keys both loops share; TrainConfig, train.py's), loop.py (the start-up both
scripts share, the optimizer step's tail), optim.py (AdamW, Muon), parallel.py (ddp | fsdp, activation
checkpointing, compile), memory.py (the estimate before allocating), flops.py (peak FLOP/s for MFU), runlog.py
(log.jsonl), checkpointing.py (saving a run, resuming it), run_dir.py (the config a run starts or resumes with, the
command that continues it), preflight.py (what a run checks before it trains).
"""
