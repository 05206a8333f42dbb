"""Shared homes for the scripts: config, device/dtype, checkpoints, tokenizers, data.

train.py, sample.py, bench.py and the tests import these; nothing here is copied
into a script. Importing any module here does no work.
"""
