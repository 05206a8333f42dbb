# Evaluate OpenAI's gpt2-large on a GPT-2-tokenized dataset (no training).
# Run: python train.py config/eval_gpt2_large.py --data_dir=data/fineweb
init_from = "gpt2-large"
eval_only = True
out_dir = "out-eval-gpt2-large"
data_dir = "data/fineweb"
batch_size = 8
block_size = 1024
eval_iters = 500  # 500 batches * 8 * 1024 = 4.1M tokens per split
