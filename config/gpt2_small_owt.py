# GPT-2 small (124M) on OpenWebText, nanoGPT's reproduction of GPT-2.
# Prepare: python data/openwebtext/prepare.py --num_proc=32      (about 17 GB of .bin)
# Train:   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small_owt.py
import os
import runpy

# The same model and schedule as gpt2_small.py; only the data differs.
globals().update({k: v for k, v in runpy.run_path(os.path.join(os.path.dirname(__file__), "gpt2_small.py")).items()
                  if not k.startswith("_")})
out_dir = "out-gpt2-small-owt"
data_dir = "data/openwebtext"
