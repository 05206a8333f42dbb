"""Shared pytest setup: the suite runs across the machine's cores, each worker on one torch thread; tests marked
`gpu` skip cleanly where CUDA is not available; torch's process-wide settings are restored after every test.

    python -m pytest                   # pytest-xdist: one worker per CPU (-n auto --dist worksteal)
    python -m pytest -n 0              # one process, in file order (also -p no:xdist, and --pdb)
    python -m pytest -m "not slow"     # the loop while working: leaves out the slow ones (every test over 20 s)

The markers themselves (`slow`, `gpu`) are declared in pytest.ini.
"""
import os

import pytest
import torch


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # Parallel unless the command line says otherwise (-n 0), xdist is disabled (-p no:xdist), or this process is
    # itself a worker. Set here rather than in pytest.ini's addopts, where -n would be an unknown option under
    # -p no:xdist.
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.numprocesses is None:
        config.option.numprocesses = "auto"  # pytest_xdist_auto_num_workers below (none under --pdb)
    if config.option.dist == "no":
        # Each worker starts on a contiguous share of the files and takes half of another's remaining tests when it
        # runs out: a module's tests stay together, so its module-scoped fixtures (trained models, servers) are
        # built on one worker, rarely two.
        config.option.dist = "worksteal"


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown under -p no:xdist
def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per CPU this process may use, hyperthreads too (much of the suite waits on subprocesses,
    servers and the disk), and at most one per 2 GiB of memory (the suite's largest process peaks near 1.3 GB).
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides it, as in xdist itself."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cpus, memory // 2**31))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; no GPU on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not a keyword: a folder named gpu is one too
            item.add_marker(skip_gpu)


def pytest_configure(config):
    # The tests use tiny models: a second thread gains nothing, and with one worker per core a second thread
    # per worker only makes OpenMP threads wait for each other (many times slower on a busy machine). Timing
    # is never tested. The scripts default to torch's own count (one per core), so every script a test
    # launches inherits one thread from the environment, whichever way it is started. Each xdist worker
    # runs this too.
    torch.set_num_threads(1)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


# torch's process-wide settings as (read, write) through torch's own accessors. The backend flags are not plain
# attributes: torch.backends.cuda.matmul serves allow_tf32 through __getattr__/__setattr__ and refuses delattr, so
# monkeypatch.setattr's undo (which since pytest 9.2 deletes what the instance __dict__ did not hold) cannot
# restore them.
TORCH_SETTINGS = {
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "deterministic": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "cuda.matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                               lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    "cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                         lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
}


@pytest.fixture(autouse=True)
def restore_torch_settings():
    """Every setting in TORCH_SETTINGS as it was before the test: code under test may set one (train.py's
    threads, TF32 on CUDA), and whichever test a worker runs next must not inherit it."""
    saved = {name: read() for name, (read, _) in TORCH_SETTINGS.items()}
    yield saved
    for name, value in saved.items():
        if TORCH_SETTINGS[name][0]() != value:
            TORCH_SETTINGS[name][1](value)
