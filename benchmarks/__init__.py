"""bench.py's sections, one module each (bench.py's SECTIONS), and what they share (common.py, nanogpt.py, race.py)."""
