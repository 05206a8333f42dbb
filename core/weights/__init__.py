"""The weights wing: where a model's weights come from, and the formats they travel in.

resolver.py (init_from -> located, then built), checkpoint.py (our checkpoint files and nanoGPT's, read), hf.py (our
recipes <-> transformers classes), hf_export.py (a model -> a transformers folder), gguf.py (a transformers folder ->
a GGUF file).
"""
