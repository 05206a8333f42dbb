# RL on the synthetic tasks (core/data/tasks.py) from the chat fine-tune of the CPU quick-start model
# (config/sft_tasks_char.py; docs/chat.md). Every reply is scored by its task's checker, exact match.
# Before: the chat quick start of docs/chat.md (base, tasks.py, prepare, SFT into out-sft-tasks-char)
# Train:  python rl.py config/rl_tasks_char.py
# Score:  python eval.py --out_dir=out-rl-tasks-char --task=reverse    (and --task=upper)

init_from = "out-sft-tasks-char"
out_dir = "out-rl-tasks-char"
tasks = "reverse,upper"

# 16 prompts x 8 replies = 128 scored replies per iteration, the tasks taking turns
prompts_per_iter = 16
samples_per_prompt = 8
temperature = 1.0
max_new_tokens = 16       # the answers are 3 to 6 characters and <|end|>

learning_rate = 1e-3
min_lr = 1e-4
max_iters = 200
eval_interval = 25
eval_examples = 100
log_interval = 10
