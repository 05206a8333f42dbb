"""The training wing: what a run (train.py's, rl.py's) adds to a model and a dataset.

train_config.py (the keys), loop.py (what both loops share), optim.py (AdamW, Muon), parallel.py (ddp | fsdp),
memory.py (the estimate), flops.py (peak FLOP/s), runlog.py (log.jsonl), checkpointing.py (saving, resuming),
run_dir.py (the config a run starts or resumes with), preflight.py (the checks before training).
"""
