# GPT-2 small (124M) from scratch on FineWeb's 10B-token sample, as llm.c and the speedruns do.
# Prepare: python data/fineweb/prepare.py --num_proc=32          (about 20 GB of .bin)
# Train:   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py

out_dir = "out-gpt2-small"
data_dir = "data/fineweb"

# 12 batch * 1024 context * 40 accumulation = 491,520 tokens per iteration (~0.5M, as GPT-3 small).
# gradient_accumulation_steps counts all processes together: 40 = 5 per GPU on 8 GPUs.
# batch_size is nanoGPT's 12: the micro-batch that fills a GPU comes from bench.py's sweep (8 to 64 sequences,
# scripts/gpu_check.sh), not measured yet (docs/performance.md, "On a GPU"); keep batch * accumulation ~0.5M.
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = True
vocab_size = 50304  # 50257 rounded up to a multiple of 64: faster matmuls, the extra ids are never used

# 600,000 iterations * 491,520 tokens = 295B tokens, nanoGPT's full run; FineWeb 10B is
# about 20,000 iterations per epoch: shorten with --max_iters=20000 --lr_decay_iters=20000.
learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1

eval_interval = 1000
eval_iters = 200
log_interval = 10
