# Chat fine-tune of the CPU quick-start model on the demonstrations of the checked tasks (sort and palindrome
# of 3 to 5 letters, core/data/tasks.py): the SFT that rl.py's proof starts from (docs/chat.md). Give the base
# config first: its architecture and batch apply, and this file overrides the rest.
# Data:  python data/chat/tasks.py --tasks=sort,palindrome --n_train=20000 --out_dir=data/chat_checked
#        python data/chat/prepare.py --input=data/chat_checked/tasks_train.jsonl --tokenizer_from=out-shakespeare-char-cpu --block_size=64 --out_dir=data/chat_checked
# Train: python train.py config/train_shakespeare_char_cpu.py config/sft_checked_char.py

init_from = "out-shakespeare-char-cpu"  # the base run's weights; a new run (fresh optimizer and schedule)
out_dir = "out-sft-checked-char"
data_dir = "data/chat_checked"

eval_interval = 500
eval_iters = 20
log_interval = 50

learning_rate = 2e-3
max_iters = 3000
lr_decay_iters = 3000
min_lr = 2e-4
warmup_iters = 50
