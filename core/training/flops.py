"""Peak FLOP/s for MFU (GPT.estimate_mfu divides by it): known GPUs' datasheet figure, a measured CPU matmul, or none.
"""
import math
import os
import time

import torch

from core.runtime import Runtime

# Dense peak FLOP/s: NVIDIA's datasheet tensor-core figures are quoted with 2:4 sparsity, halved here; "tf32" is a
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
