# The modern recipe as overrides that compose after any config:
#     python train.py config/train_shakespeare_char_cpu.py config/modern.py
# Every value here was measured against classic GPT-2 with compare_recipe.py (README "Modern recipe").

pos_embedding = "rope"  # relative positions, no wpe table
norm = "rmsnorm"        # LayerNorm without the mean and the bias: fewer ops, same quality
qk_norm = True          # bounded attention scores: lets Muon's large steps train stably
mlp = "relu2"           # ReLU squared: the speedrun's choice, as cheap as GELU
tie_embeddings = False  # the head and the embedding want different things once Muon trains the matrices
logit_softcap = 15.0    # no runaway confident logits early in training
optimizer = "muon"      # Muon for the hidden matrices, AdamW (learning_rate) for embeddings, head, gains
muon_lr = 0.02
