"""The data wing: text to token files, and token files to batches.

tokenizer.py (every kind behind one interface), hf_tokenizer.py (tokenizer.json both ways), chat.py (the chat
template), tasks.py (tasks with checkers: a prompt generator and a reward each), loader.py (token files ->
batches), and preparing: writer.py (the output folder, token files, shards, meta.json), corpus.py (any text
files -> documents -> train/val; the --tokenizer a corpus is prepared with, each document's marks), web.py
(hub-sized corpora in worker processes). Nothing here imports the model or the decoding wing, so preparing
data loads neither.
"""
