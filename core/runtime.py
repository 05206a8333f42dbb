"""Device, dtype, autocast and process-group setup: decided here once for every script; the device's peak FLOP/s.

Distributed training is detected from torchrun's environment; with one process setup() joins no group, same code
path. Two small host-side (gloo) groups sit beside the training one, so agreeing on control flow never waits for the
GPU: `any_rank` (a signal or a bad loss on any rank) and `on_master` (rank 0 writes a file, all learn how it went).
"""
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from core import cpu
from core.errors import Stopped, UserError, first_line

# The dtypes every script accepts (--dtype, export.py's stored weights): their one home.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# How long the other ranks wait for rank 0's file writes (on_master): a checkpoint of a large model
# on a slow filesystem takes minutes, far past a collective's dist_timeout_s. A rank 0 that dies
# meanwhile ends the job at once (torchrun stops the others); only a hung rank 0 waits this long.
MASTER_WORK_TIMEOUT = datetime.timedelta(hours=2)


@dataclasses.dataclass
class Runtime:
    device: str            # "cuda:0", "cpu", "mps"
    device_type: str       # "cuda", "cpu", "mps"
    dtype: str             # "float32", "bfloat16", "float16"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    flag_group: object = dataclasses.field(default=None, repr=False, compare=False)    # gloo, dist_timeout_s
    master_group: object = dataclasses.field(default=None, repr=False, compare=False)  # gloo, MASTER_WORK_TIMEOUT

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def ptdtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling for float16, whose narrow exponent flushes small gradients to zero; a no-op otherwise."""
        return torch.amp.GradScaler(self.device_type, enabled=self.dtype == "float16")

    def autocast(self):
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.ptdtype)

    def synchronize(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        elif self.device_type == "mps":
            torch.mps.synchronize()

    def any_rank(self, *flags: bool) -> list[bool]:
        """Each flag, true if it is true on any rank: one host-side all-reduce, no GPU sync."""
        if not self.distributed:
            return list(flags)
        t = torch.tensor([float(f) for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.flag_group)
        return [bool(v) for v in t.tolist()]

    def on_master(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on rank 0 only (a file write); every rank returns once it is done. If it fails, every
        rank raises the same one-line UserError: the others would otherwise wait in their next collective until
        dist_timeout_s, and end with a timeout, not the cause."""
        error, result = None, None
        if self.is_master:
            try:
                result = fn(*args, **kwargs)
            except UserError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here as it is
                if not self.distributed:
                    raise
                error = f"rank 0 failed: {type(e).__name__}: {first_line(e)}"
                self._tell_outcome(error)
                raise
        if self.distributed:
            error = self._tell_outcome(error)
        if error is not None:
            raise UserError(error)
        return result

    def _tell_outcome(self, error: str | None) -> str | None:
        box = [error]
        dist.broadcast_object_list(box, src=0, group=self.master_group)
        return box[0]


def resolve_device(name: str, local_rank: int | None = None) -> str:
    """'auto' picks cuda, then mps, then cpu; an explicit device must exist here. CUDA devices always come back
    indexed ("cuda:1"): torch.cuda.set_device refuses a bare "cuda". Under torchrun (local_rank given) a bare "cuda"
    or "auto" means this process's GPU, cuda:LOCAL_RANK."""
    if name == "auto":
        if torch.cuda.is_available():
            return resolve_device("cuda", local_rank)
        return "mps" if torch.backends.mps.is_available() else "cpu"
    kind, _, index_text = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or kind == "cuda" and index_text and not index_text.isdigit():
        raise UserError(f"unknown device '{name}'; use auto, cpu, cuda, cuda:N or mps")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device '{name}' was asked for but MPS is not available here; use --device=cpu")
    if kind != "cuda":
        return name
    if not torch.cuda.is_available():
        raise UserError(f"device '{name}' was asked for but this machine has no CUDA GPU; use --device=cpu or --device=auto")
    count = torch.cuda.device_count()
    if not index_text and local_rank is not None:
        return f"cuda:{local_gpu(local_rank, count)}"
    index = int(index_text or 0)
    if index >= count:
        raise UserError(f"device '{name}' does not exist: this machine has {count} CUDA device(s)")
    return f"cuda:{index}"


def local_gpu(local_rank: int, count: int) -> int:
    """The GPU index of torchrun's LOCAL_RANK among the `count` visible ones. One visible GPU with LOCAL_RANK > 0 is
    a scheduler giving each task its own GPU (SLURM --gpus-per-task=1 sets CUDA_VISIBLE_DEVICES per task): ours."""
    if local_rank < count:
        return local_rank
    if count == 1:
        return 0
    raise UserError(f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                    f"start at most {count} processes per node (torchrun --nproc_per_node={count})")


def native_bf16(device: str) -> bool:
    """Whether the device computes bfloat16 in hardware: AMD GPUs and NVIDIA's sm80+, not MPS (float32 is safe there).
    Not torch.cuda.is_bf16_supported(), which also says yes for emulated bf16 (V100, T4): matmuls many times slower."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return cpu.cpu_native_bf16()
    return kind == "cuda" and (bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0))


def resolve_dtype(name: str, device: str) -> str:
    """'auto' is bfloat16 where native_bf16, else float16 on CUDA (with a GradScaler), else float32. bfloat16 is
    autocast over the forward, never the stored model: weights, optimizer state and gradients stay float32, since a
    bf16 weight (8 bits of mantissa) cannot take an update under 1/256 of itself. The matmuls run in bf16; float32 stay
    the residual stream (so every norm normalises float32 values; q/k norm sums in float32), the loss (a log-sum-exp
    over the vocabulary would round in bf16) and at sampling the next-token logits (bf16 would round close scores into
    ties)."""
    kind = device.split(":")[0]
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float16" if kind == "cuda" else "float32"
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}'; use {', '.join(DTYPES)} or auto")
    if name == "float32":
        return name
    if kind == "mps":
        raise UserError(f"dtype {name} is not supported on mps; use --dtype=float32 there")
    if name == "float16" and kind != "cuda":
        raise UserError(f"dtype float16 is not supported on {kind}: its loss scaling runs on CUDA only; use "
                        f"--dtype=auto (bfloat16 where this CPU computes it natively, else float32)")
    if name == "bfloat16" and not native_bf16(device):
        if kind == "cpu":
            raise UserError(f"dtype bfloat16 is not supported on this CPU: it has no native bfloat16 "
                            f"(no AVX512-BF16, AMX or ARM BF16 in use; torch's kernels: "
                            f"{torch.backends.cpu.get_cpu_capability()}), so bf16 matmuls are emulated, "
                            f"many times slower than float32; use --dtype=float32 or --dtype=auto")
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(f"{torch.cuda.get_device_name(device)} (sm{major}{minor}) has no native bfloat16 (it would be "
                        f"emulated, many times slower); use --dtype=float16 or --dtype=auto")
    return name


def dist_env() -> tuple[int, int, int]:
    if "RANK" not in os.environ:
        return 0, 0, 1
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def set_threads(threads: int) -> None:
    """torch's intra-op CPU threads: `threads` if positive; 0 keeps torch's default (one per core, or
    OMP_NUM_THREADS). The one place the scripts' --threads acts."""
    if threads < 0:
        raise UserError(f"threads must be 0 (torch's default) or a positive count, got {threads}")
    if threads:
        torch.set_num_threads(threads)


BACKENDS = ("auto", "nccl", "gloo")  # the process group's; auto: nccl on CUDA, gloo elsewhere


def setup(device: str = "auto", dtype: str = "auto", timeout_s: float = 600.0, threads: int = 0,
          backend: str = "auto") -> Runtime:
    """Pick device and dtype and the CPU threads (set_threads); join the process group (backend, BACKENDS) when
    launched by torchrun."""
    set_threads(threads)
    rank, local_rank, world_size = dist_env()
    device = resolve_device(device, local_rank if world_size > 1 else None)
    device_type = device.split(":")[0]
    if world_size > 1 and device_type == "cuda" and device != f"cuda:{local_gpu(local_rank, torch.cuda.device_count())}":
        raise UserError(f"--device={device} under torchrun: each process uses its own GPU (cuda:LOCAL_RANK); "
                        f"use --device=cuda or --device=auto")
    if device_type == "cuda":
        # Before anything touches CUDA (the dtype probe included): otherwise every rank opens a context on GPU 0.
        torch.cuda.set_device(device)
        # TF32 matmuls: several times float32's throughput on Ampere+, at a precision training tolerates.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = resolve_dtype(dtype, device)
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    elif backend == "nccl" and device_type != "cuda":
        raise UserError(f"backend nccl runs on CUDA GPUs only, and this run is on {device}; use --backend=gloo or auto")
    flag_group = master_group = None
    if world_size > 1:
        # A finite timeout: a dead peer ends the job with an error instead of a hang.
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _torchrun_attempt_store(world_size, timeout)
        dist.init_process_group(backend=backend, timeout=timeout,
                                device_id=torch.device(device) if backend == "nccl" else None,
                                **(dict(store=store, rank=rank, world_size=world_size) if store is not None else {}))
        # Host-side groups (see the module docstring); a gloo default group already is one.
        flag_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        # gloo's timeout is each process's own: the others wait long for rank 0's write, while rank 0,
        # whose send waits only for them to be ready to receive, gives up on a hung peer after timeout_s.
        master_group = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else max(timeout, MASTER_WORK_TIMEOUT))
    return Runtime(device, device_type, dtype, rank, local_rank, world_size, flag_group, master_group)


def _torchrun_attempt_store(world_size: int, timeout: datetime.timedelta) -> "dist.Store | None":
    """torchrun's shared TCPStore, its keys prefixed per restart (None outside its agent store): every restart gets the
    same store and the group's keys carry no attempt number, so restarted workers could read the addresses of those
    they replace and fail with 'Connection refused'. torch's env:// handler assumes this prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def teardown(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        # DDP's reducer (which holds the process group and its last async work) lives on in a reference cycle after
        # training returns; freed at the interpreter's shutdown, gloo's threads take the GIL too late and the process
        # aborts ("terminate called without an active exception"). Free it while Python is fully alive.
        gc.collect()
        dist.destroy_process_group()


class StopFlag:
    """Set by SIGTERM/SIGINT, and SIGHUP unless ignored (nohup); the work stops at its next boundary (a step, an eval
    batch, a start-up phase). The first signal prints `message` at once (when `announce`), so a long step is not
    mistaken for a lost Ctrl-C; a second SIGINT interrupts at once."""

    def __init__(self, announce: bool = True, message: str = "stopping after this batch; saving"):
        self.signal_name, self.announce, self.message = None, announce, message

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        hangup = getattr(signal, "SIGHUP", None)  # POSIX only
        if hangup is not None and signal.getsignal(hangup) is not signal.SIG_IGN:  # nohup asked to keep going
            signal.signal(hangup, self._handle)
        return self

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def check(self, where: str) -> None:
        """Raise Stopped if a signal came: `where` says what had not happened yet ("before training")."""
        if self.requested:
            raise Stopped(self.signal_name, where)

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        if not self.announce:
            return
        line = f"{self.signal_name}: {self.message} (Ctrl-C again to interrupt at once)\n"
        try:  # os.write, not print, which would raise if this handler interrupted a write to the same buffered stream
            os.write(sys.stderr.fileno(), line.encode())
        except (AttributeError, OSError, ValueError):  # a stderr with no file (captured in-process)
            sys.stderr.write(line)


# Peak FLOP/s for MFU (GPT.estimate_mfu divides by it): known GPUs' datasheet figure, a measured CPU matmul, or none.
# Dense peaks: NVIDIA's datasheet tensor-core figures are quoted with 2:4 sparsity, halved here; "tf32" is a
# float32 run with TF32 matmuls (setup() turns them on), "float32" the CUDA cores'. Matched by substring of the
# device name, most specific first: "NVIDIA H100 NVL" and "NVIDIA H100 PCIe" must not match the SXM "H100" row.
DATASHEET_PEAK_FLOPS = (
    ("H200 NVL", {"bfloat16": 1671e12 / 2, "float16": 1671e12 / 2, "tf32": 835e12 / 2, "float32": 60e12}),
    ("H200", {"bfloat16": 1979e12 / 2, "float16": 1979e12 / 2, "tf32": 989e12 / 2, "float32": 67e12}),
    ("H100 NVL", {"bfloat16": 1671e12 / 2, "float16": 1671e12 / 2, "tf32": 835e12 / 2, "float32": 60e12}),
    ("H100 PCIe", {"bfloat16": 1513e12 / 2, "float16": 1513e12 / 2, "tf32": 756e12 / 2, "float32": 51e12}),
    ("H100", {"bfloat16": 1979e12 / 2, "float16": 1979e12 / 2, "tf32": 989e12 / 2, "float32": 67e12}),  # SXM
    ("A100", {"bfloat16": 624e12 / 2, "float16": 624e12 / 2, "tf32": 312e12 / 2, "float32": 19.5e12}),
)


def cpu_matmul_peak_flops(n: int = 1024, repeats: int = 10, dtype: torch.dtype = torch.float32,
                          budget_s: float = 1.0) -> float:
    """Measured matmul FLOP/s in `dtype` on this CPU, with torch's thread count: the honest 'peak' for CPU MFU. The
    fastest of several runs (slower ones measure other processes sharing the cores); fewer once they take budget_s
    (a half precision the CPU only emulates takes seconds a matmul)."""
    gen = torch.Generator().manual_seed(0)  # never touch the global RNG: training draws from it
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    a @ b  # warm-up
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best, spent = min(best, time.perf_counter() - t0), spent + time.perf_counter() - t0
        if spent > budget_s:
            break
    return 2 * n**3 / best


def peak_flops_with_source(rt: Runtime) -> tuple[float | None, str]:
    """(peak FLOP/s or None, which figure it is): None, saying why, where MFU would be wrong."""
    if rt.device_type == "cpu":
        # In the run's dtype: a bf16 run against float32's peak would overstate its MFU.
        return cpu_matmul_peak_flops(dtype=rt.ptdtype), (f"measured {rt.dtype} 1024x1024 matmul, fastest of 10 "
                                                          f"or of 1 s (cpu_matmul_peak_flops)")
    if rt.device_type != "cuda":
        return None, f"no peak figure for {rt.device_type}; MFU not reported"
    name = torch.cuda.get_device_name(rt.device)
    # A MIG slice has a fraction of the GPU's SMs, which its name does not say reliably.
    if "MIG" in name or os.environ.get("CUDA_VISIBLE_DEVICES", "").startswith("MIG-"):
        return None, f"{name} is a MIG slice, a fraction of the GPU; MFU not reported"
    kind = rt.dtype
    if kind == "float32" and torch.backends.cuda.matmul.allow_tf32:
        kind = "tf32"
    for key, table in DATASHEET_PEAK_FLOPS:
        if key.lower() in name.lower():
            return table[kind], f"datasheet dense {kind} of {key} ({name}): {table[kind] / 1e12:.1f} TFLOP/s"
    return None, f"no datasheet figure for {name}; MFU not reported"
