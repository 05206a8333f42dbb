"""What every script shares, by wing; the scripts import these and model.py, never each other.

The ground floor, used everywhere: config.py (dataclass defaults <- config files <- --key=value), errors.py (one
line, a non-zero exit), runtime.py (device, dtype, threads, process groups, the stop flag), cpu.py (the CPU's
kernel choices, for training and decoding alike), kernels.py (the kernels a forward runs, set from outside),
fileio.py (atomic writes).

The wings, each a package whose docstring lists its rooms: training/, data/, weights/, decoding/, evaluation/,
serving/. Importing any module here does no work.
"""
