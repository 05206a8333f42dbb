# RL on the checked tasks (sort and palindrome of 6 or 7 letters, core/data/tasks.py) from the SFT on their
# demonstrations, of 3, 4, 5 and 8 letters and one in fifty of 6 or 7 (docs/chat.md): RL's prompts come with the
# checker only. --update=rft fine-tunes on the accepted replies instead (rejection sampling).
# Before: the base run, then the data and SFT commands of docs/chat.md (the checked tasks' proof)
# Train:  python rl.py config/rl_checked_char.py
# Score:  python eval.py --out_dir=out-rl-checked-char --task=sort --task_split=longer

init_from = "out-sft-checked-char"
out_dir = "out-rl-checked-char"
tasks = "sort,palindrome"

# 16 prompts x 8 replies = 128 scored replies per iteration, the tasks taking turns
prompts_per_iter = 16
samples_per_prompt = 8
temperature = 1.0
max_new_tokens = 20       # the longest accepted reply here: a palindrome of 7 + 6 letters, then <|end|>

learning_rate = 3e-4
min_lr = 3e-5
max_iters = 200
eval_interval = 50
eval_examples = 100
log_interval = 1          # every iteration's record: its forward and backward tokens add up to the run's compute
