# The speedrun's recipe (docs/speedrun.md) as overrides after the CPU quick start and the modern recipe:
#     python train.py config/train_shakespeare_char_cpu.py config/modern.py config/speedrun_char.py
# benchmarks/speedrun.py races exactly these settings (its default speedrun_ours names this file). They reach
# nanoGPT's loss after its 2,000 iterations (1.8883 on the whole val split) in about 400: the schedule is
# sized to that, with a short warm-up and AdamW (embeddings, head, gains) at 4x the base rate.

out_dir = "out-speedrun-char"
max_iters = 400         # 400 * 768 tokens = 307,200, against nanoGPT's 1,536,000
lr_decay_iters = 400    # the cosine ends where the run does
warmup_iters = 20
learning_rate = 4e-3    # AdamW's groups; Muon keeps config/modern.py's muon_lr
value_embeds = 1        # a value embedding in the first and the last Block (docs/speedrun.md, levers)
mlp_hidden = 256        # a SwiGLU 256 wide, not 341: less time per iteration, the same loss at 400
