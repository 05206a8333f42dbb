# Chat fine-tune of the CPU quick-start model (config/train_shakespeare_char_cpu.py) on the synthetic
# tasks of data/chat/tasks.py (docs/chat.md). Give the base config first: its architecture and batch
# apply, and this file overrides the rest.
# Data:  python data/chat/tasks.py
#        python data/chat/prepare.py --input=data/chat/tasks_train.jsonl --tokenizer_from=out-shakespeare-char-cpu --block_size=64
# Train: python train.py config/train_shakespeare_char_cpu.py config/sft_tasks_char.py
# Try:   python sample.py --out_dir=out-sft-tasks-char --chat --prompt="reverse: hello" --temperature=0

init_from = "out-shakespeare-char-cpu"  # the base run's weights; a new run (fresh optimizer and schedule)
out_dir = "out-sft-tasks-char"
data_dir = "data/chat"

eval_interval = 250
eval_iters = 20
log_interval = 50

# 12 rows x 64 tokens hold about 25 conversations (each row starts at a conversation), so
# 1,000 iterations see the 3,600 train conversations about seven times.
learning_rate = 2e-3
max_iters = 1000
lr_decay_iters = 1000
min_lr = 2e-4
warmup_iters = 50
