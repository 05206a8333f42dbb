"""The sections of bench.py (its SECTIONS), one module each, and what they share.

Sections: train.py, loop.py, attention.py, decode.py, prepare.py, memory.py, serve.py, speedrun.py, peers.py.
Shared: common.py (timing, peak memory, OOM, the settings' checks, the tables), nanogpt.py (nanoGPT's loop, the
yardstick), bandwidth.py (the decode step's bytes and its bound), fixed_step.py (the fixed-shape decode step against
the eager one).
"""
