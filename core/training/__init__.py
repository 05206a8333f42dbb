"""The training wing: what train.py (and rl.py) add to a model and a dataset.

train_config (RunConfig, the keys both loops share; TrainConfig, the schedule, the optimizer it asks for), loop
(the start-up both scripts share, the optimizer step's tail), optim (AdamW, Muon), parallel (ddp | fsdp,
activation checkpointing, compile, the CPU's kernels), memory (the estimate before allocating), flops (peak FLOP/s for MFU), runlog
(log.jsonl), checkpointing (saving a run), run_dir (the guards of out_dir and of a resume).
"""
