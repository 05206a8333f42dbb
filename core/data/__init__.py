"""The data wing: text to token files, and token files to batches.

tokenizer (every kind behind one interface), hf_tokenizer (tokenizer.json both ways), chat (the chat template),
loader (token files -> batches), and preparing: sources (a corpus's text, the output folder), writer (token
files, shards, meta.json), corpus_tokenizer (the --tokenizer a corpus is prepared with, each document's
marks), corpus (any text files -> documents -> train/val), web (hub-sized corpora in worker processes).
"""
