"""The data wing: text to token files, and token files to batches.

tokenizer.py (every kind behind one interface), hf_tokenizer.py (tokenizer.json both ways), chat.py (the template),
tasks.py (tasks with checkers), loader.py (token files -> batches), and preparing: writer.py (token files,
meta.json), corpus.py (any text files), web.py (hub-sized corpora). Nothing here imports the model or the decoding
wing, so preparing data loads neither.
"""
