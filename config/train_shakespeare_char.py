# The baby GPT: a 10.7M-parameter character-level model of Shakespeare.
# Prepare: python data/shakespeare_char/prepare.py
# Train:   python train.py config/train_shakespeare_char.py      (one GPU)
# Sample:  python sample.py --out_dir=out-shakespeare-char

out_dir = "out-shakespeare-char"
eval_interval = 250  # the model overfits quickly: evaluate often
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # keep only val-loss improvements

data_dir = "data/shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # 64 batch * 256 context = 16,384 tokens per iteration

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # a small model can take a larger step
max_iters = 5000
lr_decay_iters = 5000  # usually equal to max_iters
min_lr = 1e-4  # learning_rate / 10, per Chinchilla
beta2 = 0.99  # a little larger: few tokens per iteration
warmup_iters = 100
