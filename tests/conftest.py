"""Shared pytest setup: tests marked `gpu` skip cleanly where CUDA is not available.

The markers themselves (`slow`, `gpu`) are declared in pytest.ini.
"""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; no GPU on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not a keyword: a folder named gpu is one too
            item.add_marker(skip_gpu)


def pytest_configure(config):
    # The tests use tiny models: a second thread gains nothing, and on a busy two-core machine
    # OpenMP threads waiting for each other make them many times slower. Timing is never tested.
    # The scripts default to torch's own count (one per core), so every script a test launches
    # inherits one thread from the environment, whichever way it is started.
    torch.set_num_threads(1)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


# torch's backend flags as (read, write) through torch's own accessors. They are not plain attributes:
# torch.backends.cuda.matmul serves allow_tf32 through __getattr__/__setattr__ and refuses delattr, so
# monkeypatch.setattr's undo (which since pytest 9.2 deletes what the instance __dict__ did not hold)
# cannot restore them. A test that lets the code under test set one saves and restores it here.
BACKEND_FLAGS = {
    "cuda.matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                               lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    "cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                         lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
}


@pytest.fixture
def restore_backend_flags():
    """Reads every flag in BACKEND_FLAGS, yields, and sets each back through torch's setter."""
    saved = {name: read() for name, (read, _) in BACKEND_FLAGS.items()}
    yield saved
    for name, value in saved.items():
        BACKEND_FLAGS[name][1](value)
