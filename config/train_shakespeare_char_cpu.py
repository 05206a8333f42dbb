# The CPU quick start: a 0.8M-parameter character-level Shakespeare model that trains on a CPU
# (docs/performance.md has the measured time).
# Prepare: python data/shakespeare_char/prepare.py
# Train:   python train.py config/train_shakespeare_char_cpu.py
# Sample:  python sample.py --out_dir=out-shakespeare-char-cpu

out_dir = "out-shakespeare-char-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 50

data_dir = "data/shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64  # 12 batch * 64 context = 768 tokens per iteration

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100

device = "cpu"
dtype = "auto"  # bfloat16 autocast where the CPU computes it natively (AVX512-BF16, AMX), else float32
compile = False
