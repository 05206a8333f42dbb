"""The weights wing: where a model's weights come from, and the formats they travel in.

resolver (init_from -> scratch | resume | a run | a transformers folder | a GPT-2 name, decided once), checkpoint
(our checkpoint files, read), hf (our recipes <-> transformers classes).
"""
