"""Device, dtype, autocast and process-group setup: decided here once for every script.

`setup(device, dtype)` returns a Runtime. Distributed training is detected from
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE): with one process it is a
no-op and the same code path runs.
"""
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import time

import torch
import torch.distributed as dist

from core.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Dense (no sparsity) peak FLOP/s from the vendors' datasheets, for MFU.
DATASHEET_PEAK_FLOPS = {
    # substring of torch.cuda.get_device_name(): {dtype: FLOP/s}
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
}


@dataclasses.dataclass
class Runtime:
    device: str            # "cuda:0", "cpu", "mps"
    device_type: str       # "cuda", "cpu", "mps"
    dtype: str             # "float32", "bfloat16", "float16"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def ptdtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def autocast(self):
        """Mixed precision for the forward pass; float32 runs as is."""
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.ptdtype)

    def synchronize(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        elif self.device_type == "mps":
            torch.mps.synchronize()


def resolve_device(name: str) -> str:
    """'auto' picks cuda, then mps, then cpu; an explicit device must exist here."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    kind = name.split(":")[0]
    if kind == "cpu":
        return name
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device '{name}' was asked for but this machine has no CUDA GPU; use --device=cpu or --device=auto")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device '{name}' does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return name
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise UserError(f"device '{name}' was asked for but MPS is not available here; use --device=cpu")
        return name
    raise UserError(f"unknown device '{name}'; use auto, cpu, cuda, cuda:N or mps")


def resolve_dtype(name: str, device_type: str) -> str:
    """'auto' is bfloat16 on GPUs that support it, else float16 on CUDA, else float32."""
    if name == "auto":
        if device_type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return "float32"
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}'; use float32, bfloat16, float16 or auto")
    if name != "float32" and device_type != "cuda":
        # CPU autocast runs, but these CPUs have no fast bf16 (~100x slower matmuls) and
        # float16 needs a GradScaler path we only support on CUDA.
        raise UserError(f"dtype {name} is not supported on {device_type}; use --dtype=float32 there")
    if name == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise UserError("dtype bfloat16 is not supported by this GPU; use --dtype=float16")
    return name


def dist_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) without it."""
    if "RANK" not in os.environ:
        return 0, 0, 1
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def setup(device: str = "auto", dtype: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """Pick device and dtype; join the process group when launched by torchrun."""
    rank, local_rank, world_size = dist_env()
    device = resolve_device(device)
    device_type = device.split(":")[0]
    if world_size > 1 and device_type == "cuda":
        device = f"cuda:{local_rank}"
    dtype = resolve_dtype(dtype, device_type)
    if device_type == "cuda":
        torch.cuda.set_device(device)
        # TF32 matmuls: ~8x the float32 throughput on Ampere+ at a precision training tolerates.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1:
        # A finite timeout: a dead peer ends the job with an error instead of a hang.
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _torchrun_attempt_store(world_size, timeout)
        dist.init_process_group(
            backend="nccl" if device_type == "cuda" else "gloo",
            timeout=timeout,
            device_id=torch.device(device) if device_type == "cuda" else None,
            **(dict(store=store, rank=rank, world_size=world_size) if store is not None else {}),
        )
    return Runtime(device, device_type, dtype, rank, local_rank, world_size)


def _torchrun_attempt_store(world_size: int, timeout: datetime.timedelta) -> "dist.Store | None":
    """torchrun's shared TCPStore with its keys kept apart per restart; None outside torchrun's agent store.

    torchrun (--max-restarts) gives every restart of the workers the same store, and the default
    process group's keys carry no attempt number: restarted workers can read the gloo/NCCL addresses of
    the workers they replace and fail with 'Connection refused' (PyTorch 2.13: 4 restarts in 5 failed here).
    A prefix per TORCHELASTIC_RESTART_COUNT is what torch's own env:// handler assumes it has.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def teardown(rt: Runtime) -> None:
    if rt.ddp and dist.is_initialized():
        # DDP's reducer (which holds the process group and its last async work) lives on in a
        # reference cycle after training returns; left to the interpreter's shutdown, freeing it makes
        # gloo's threads take the GIL too late and the process aborts ("terminate called without an
        # active exception", seen once in ~10 torchrun restarts). Free it while Python is fully alive.
        gc.collect()
        dist.destroy_process_group()


def cpu_matmul_peak_flops(n: int = 1024, repeats: int = 10) -> float:
    """Measured float32 matmul FLOP/s on this CPU, with torch's current thread count: the honest
    'peak' for CPU MFU. The fastest of several runs, since a peak is what the hardware can reach
    and slower runs only measure other processes sharing the cores."""
    gen = torch.Generator().manual_seed(0)  # never touch the global RNG: training draws from it
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(rt: Runtime) -> float | None:
    """Peak FLOP/s for MFU: the datasheet for known GPUs, a measured matmul on CPU, else None."""
    if rt.device_type == "cuda":
        name = torch.cuda.get_device_name(rt.device)
        for key, table in DATASHEET_PEAK_FLOPS.items():
            if key in name:
                return table[rt.dtype]
        return None
    if rt.device_type == "cpu":
        return cpu_matmul_peak_flops()
    return None
