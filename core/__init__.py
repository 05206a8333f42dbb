"""What every script shares, by wing; the scripts import these and model.py, never each other.

The ground floor, used everywhere: config.py, errors.py, runtime.py, cpu.py, kernels.py, fileio.py (each described
in README's Layout). The wings, each a package whose docstring lists its rooms: training/, data/, weights/,
decoding/, evaluation/, serving/. Importing any module here does no work.
"""
