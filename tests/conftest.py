"""Shared pytest setup: tests marked `gpu` skip cleanly where CUDA is not available.

The markers themselves (`slow`, `gpu`) are declared in pytest.ini.
"""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_configure(config):
    # The tests use tiny models: a second thread gains nothing, and on a busy two-core machine
    # OpenMP threads waiting for each other make them many times slower. Timing is never tested.
    torch.set_num_threads(1)
