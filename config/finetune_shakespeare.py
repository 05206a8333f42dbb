# Fine-tune GPT-2 (124M) on BPE Shakespeare: starts from OpenAI's weights.
# Prepare: python data/shakespeare/prepare.py
# Train:   python train.py config/finetune_shakespeare.py          (minutes on one GPU)
# Sample:  python sample.py --out_dir=out-shakespeare --start="ROMEO:"

out_dir = "out-shakespeare"
init_from = "gpt2"  # or gpt2-medium / gpt2-large / gpt2-xl, or a save_pretrained directory
data_dir = "data/shakespeare"

eval_interval = 5
eval_iters = 40
log_interval = 1
always_save_checkpoint = False  # only save when val improves

# 1 batch * 32 accumulation * 1024 context = 32,768 tokens per iteration;
# Shakespeare is ~301,966 BPE tokens for training, so one epoch is ~9.2 iterations.
batch_size = 1
gradient_accumulation_steps = 32
block_size = 1024
max_iters = 20

learning_rate = 3e-5  # fine-tune gently, at a constant rate
decay_lr = False
dropout = 0.1
