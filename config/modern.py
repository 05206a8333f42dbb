# The modern recipe as overrides that compose after any config:
#     python train.py config/train_shakespeare_char_cpu.py config/modern.py
# Each switch helped when switched on alone against classic GPT-2 in scripts/compare_recipe.py
# (CPU quick start, 2,000 iterations, whole-val-split loss; classic 1.892; docs/recipe.md), and together
# they are a function transformers computes exactly: export.py writes these runs as Qwen3ForCausalLM
# (docs/interop.md). ReLU² (alone 1.793, better than SwiGLU's 1.817) exports only without QK-norm, and
# dropping QK-norm cost more (docs/recipe.md, "Which of these recipes export"). Together: 1.581 and 1.583
# at seeds 1337 and 1338, where the ReLU² recipe reached 1.590 to 1.591 at seed 1337.

pos_embedding = "rope"  # alone: 1.791 (-0.101), 1.06x ms/iter; relative positions, no wpe table
qk_norm = True          # alone: 1.844 (-0.048); bounded scores, so Muon's large steps stay stable
norm = "rmsnorm"        # alone: 1.899 (+0.007, neutral); Qwen3 has QK-norm only with RMSNorm and SwiGLU
mlp = "swiglu"          # alone: 1.817 (-0.075); gated, GELU's parameter count
bias = False            # Qwen3's MLP has no biases
tie_embeddings = False  # alone: 1.872 (-0.020); the head and the embedding stop sharing one geometry
optimizer = "muon"      # alone: 1.635 (-0.257), the largest gain; 1.29x ms/iter at 768 tokens per step
muon_lr = 0.02          # Muon for the hidden matrices; AdamW (learning_rate) for embeddings, head, gains
# Left out, measured neutral at this scale: logit_softcap=15.0 (1.895, +0.002; no transformers class holds it).
# n_kv_head=2 (GQA; 1.902, +0.009) is for inference memory, not for quality: it is off here.
