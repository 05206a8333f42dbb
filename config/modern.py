# The modern recipe as overrides that compose after any config:
#     python train.py config/train_shakespeare_char_cpu.py config/modern.py
# Each switch helped when switched on alone against classic GPT-2 in scripts/compare_recipe.py (CPU quick
# start, 2,000 iterations, whole-val-split loss), and together they are a function transformers computes
# exactly: export.py writes these runs as Qwen3ForCausalLM (docs/interop.md). ReLU² alone beat SwiGLU but
# exports only without QK-norm, and dropping QK-norm cost more ("Which of these recipes export"). Each
# switch's loss and time per iteration, alone and together, at two seeds: docs/recipe.md, "Measured: each
# switch against GPT-2 at equal compute".

pos_embedding = "rope"  # relative positions, no wpe table
qk_norm = True          # bounded scores, so Muon's large steps stay stable
norm = "rmsnorm"        # neutral alone; Qwen3 has QK-norm only with RMSNorm and SwiGLU
mlp = "swiglu"          # gated, GELU's parameter count
bias = False            # Qwen3's MLP has no biases
tie_embeddings = False  # the head and the embedding stop sharing one geometry
optimizer = "muon"      # the largest gain of all the switches
muon_lr = 0.02          # Muon for the hidden matrices; AdamW (learning_rate) for embeddings, head, gains
# Left out, measured neutral at this scale: logit_softcap=15.0 (no transformers class holds it), and
# n_kv_head=2 (GQA), which is for inference memory, not for quality.
