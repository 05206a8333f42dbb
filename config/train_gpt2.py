# nanoGPT's config/train_gpt2.py: GPT-2 small (124M) on OpenWebText, its reproduction of GPT-2 (~2.85 val loss).
# Prepare: python data/openwebtext/prepare.py --num_proc=32      (about 17 GB of .bin)
# Train:   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
import os
import runpy

# The model, batch and schedule of gpt2_small.py (491,520 tokens per iteration, 600,000 iterations); only the
# data differs.
globals().update({k: v for k, v in runpy.run_path(os.path.join(os.path.dirname(__file__), "gpt2_small.py")).items()
                  if not k.startswith("_")})
out_dir = "out-train-gpt2"
data_dir = "data/openwebtext"
wandb_project = "owt"  # nanoGPT's; --wandb_log=True turns it on
wandb_run_name = "gpt2-124M"
