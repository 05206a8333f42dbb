"""What every script shares, by wing; the scripts import these and model.py, never each other.

The ground floor, used everywhere: config (dataclass defaults <- config files <- --key=value), errors (one line,
a non-zero exit), runtime (device, dtype, threads, process groups, the stop flag), cpu (the CPU's kernel
choices, for training and decoding alike), fileio (atomic writes), markdown (tables), evaluate (whole-split
perplexity, HellaSwag).

The wings, each a package: training/, data/, weights/, decoding/, serving/ (their docstrings list the rooms).
Importing any module here does no work.
"""
