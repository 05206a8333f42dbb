"""The data wing: text to token files, and token files to batches.

tokenizer.py (every kind behind one interface), hf_tokenizer.py (tokenizer.json both ways), chat.py (the chat
template), tasks.py (tasks with checkers: a prompt generator and a reward each), loader.py (token files ->
batches), and preparing: sources.py (a corpus's text, the output folder), writer.py (token files, shards,
meta.json), corpus_tokenizer.py (the --tokenizer a corpus is prepared with, each document's marks), corpus.py (any
text files -> documents -> train/val), web.py (hub-sized corpora in worker processes). Nothing here imports
the model or the decoding wing, so preparing data loads neither.
"""
