"""The training wing: what a run (train.py's, rl.py's) adds to a model and a dataset.

train_config.py (the keys), loop.py (what both loops share: the config a run starts or resumes with), optim.py
(AdamW, Muon), parallel.py (ddp | fsdp), memory.py (the estimate), runlog.py (log.jsonl), checkpointing.py
(saving, resuming), preflight.py (the checks before training).
"""
