"""The CPU's kernel choices: which of torch's kernels a forward runs on a CPU, and how decoding lays out weights.

The network (model.py) computes the same function whatever is chosen here; this room only picks how:

    native bfloat16    cpu_native_bf16, cpu_packs_bf16: does this CPU compute bf16 in hardware (runtime's
                       --dtype=auto asks), and is it one where decoding packs its matrices
    kernels per call   one_row_kernels, short_training_attention: the CPU's side of core/kernels.py's
                       DeviceKernels, set on a model from outside as sharding and compile are
    weights laid out   PackedLinear and pack_linears (matrices reordered once for oneDNN: bf16 ones, and a
                       float32 server's), lay_head_by_columns (a float32 head read one row at a time)
    pages              huge_pages: a server's tensors in 2 MiB pages (docs/serving.md, "Its memory in huge pages")

Each choice was measured side by side with what it replaces; the tables, commands and machines are in
docs/performance.md ("Decoding against the bandwidth bound", "Mixed precision on a CPU with native bfloat16").
"""
import contextlib
import os
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:  # for the hints only: the device's ground floor (core/runtime.py) stands below the network
    from model import GPT

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still allow bf16 instructions: AVX512_CORE_BF16 and above.
_ONEDNN_BF16_ISAS = ("ALL", "DEFAULT", "BF16", "AMX", "FP16", "AVX10")
PACK_MIN_WEIGHTS = 1 << 18  # pack_linears packs matrices this large or larger: 512 x 512 and up, all of GPT-2's
PACK_ROWS = 64  # the rows a float32 server's matrices are laid out for: faster at 4 to 16 rows than for 1
SHORT_TRAINING_MATH_KEYS = 128  # bfloat16 training on a CPU: the math backend is faster up to this many keys


def cpu_native_bf16() -> bool:
    """Whether this CPU's matmuls compute bfloat16 in hardware; elsewhere, every AVX2-only x86 CPU among them, a bf16
    matmul is emulated and many times slower than float32. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA are honoured,
    so that a machine with bf16 units can be made to answer as an AVX2 one does. Without /proc/cpuinfo (Linux's) the
    answer is False, and float32 is correct everywhere."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if not any(name in isa for name in _ONEDNN_BF16_ISAS):
        return False
    flags = _cpu_flags()
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    return "bf16" in flags  # ARM's Features line; x86 below AVX512 kernels has no bf16 units in use


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 "flags", ARM "Features") from /proc/cpuinfo; empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "Features"))]
    except OSError:
        return set()
    return set(lines[0].split(":", 1)[1].split()) if lines else set()


def huge_pages() -> None:
    """The server's tensors of 2 MiB and more in the 2 MiB pages Linux gives on request (torch reads the variable at
    its first such tensor: call before the weights load); a value the user set, 0 included, stands. Training's
    tensors, made again at every step, ran slower so (docs/serving.md)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def cpu_packs_bf16() -> bool:
    """Whether bfloat16 decoding packs its large matrices for oneDNN here (pack_linears): an x86 CPU with
    native bfloat16 (torch's AVX512 kernels), where it was measured; not ARM."""
    return cpu_native_bf16() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def one_row_kernels(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """oneDNN off for a forward of one bfloat16 row on the CPU (x (1, 1, C): decoding at batch 1). oneDNN, torch's bf16
    matmul on a CPU, is made for many rows: handed a plain matrix it lays the weight out again at every call, which at
    one row, a matrix-vector product, costs as much as the product. The large matrices are packed once for it
    (PackedLinear calls oneDNN directly, this flag or not); for the small ones torch's own GEMV gives the same floats
    in less time (at 4 rows it is slower)."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.size(0) * x.size(1) != 1:
        return contextlib.nullcontext()
    return _without_onednn()


@contextlib.contextmanager
def _without_onednn():
    onednn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = onednn


def short_training_attention(q: torch.Tensor, Tk: int, training: bool) -> contextlib.AbstractContextManager:
    """SDPA's math backend for bfloat16 attention on the CPU over at most SHORT_TRAINING_MATH_KEYS keys in a training
    forward (training mode, autograd recording q): there the flash kernel's slow bf16 backward loses; from 256 keys
    flash is the faster. Float32 and evaluation keep flash, faster there at every length measured."""
    recorded = training and torch.is_grad_enabled() and q.requires_grad
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or not recorded or Tk > SHORT_TRAINING_MATH_KEYS:
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN has reordered once into its own blocked layout for `rows` rows (pack_linears).
    bfloat16: F.linear hands oneDNN the plain (out, in) matrix, which it reorders at every call: at one row that costs
    about as much as float32's product of twice the bytes; packed, a step is faster at 1 to 64 rows, with the very
    floats of F.linear's. float32: F.linear is MKL's, whose products of 4 to 16 rows take up to twice one row's time,
    oneDNN's packed less; at one row MKL's GEMV is the faster, over the plain weight kept (one_row). torch has no
    public eager API for a weight packed once; these two ops are the ones torch.compile's CPU freezing emits."""

    def __init__(self, linear: nn.Linear, rows: int = 1, one_row: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight if one_row else None  # else it lives on only as `packed`, counted here:
        self.weight_bytes = 0 if one_row else linear.weight.numel() * linear.weight.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), rows)  # opaque
        self.bias = linear.bias

    def forward(self, x):
        if self.weight is not None and x.numel() == self.in_features:
            return nn.functional.linear(x, self.weight, self.bias)  # (..., out)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: "GPT", batched: bool = False) -> None:
    """Every Block's matrix of PACK_MIN_WEIGHTS weights or more packed for oneDNN (PackedLinear), for bf16 decoding on
    a CPU that computes it natively; smaller ones are faster as they are (one_row_kernels). Those weights then exist
    only packed; the head, the embeddings and the norms stay. batched (a float32 server's engine): the head too, all
    laid out for PACK_ROWS rows, each keeping its plain weight for one row (twice the weights' memory). For a model
    that only decodes (inference_model)."""
    heads = [("lm_head", model.lm_head)] if batched else []
    for name, module in [*model.transformer.h.named_modules(prefix="transformer.h"), *heads]:
        if isinstance(module, nn.Linear) and module.weight.numel() >= PACK_MIN_WEIGHTS:
            model.swap_module(name, PackedLinear(module, PACK_ROWS, one_row=True) if batched else PackedLinear(module))


def lay_head_by_columns(model: "GPT") -> None:
    """Decoding in float32 on a CPU: the head's storage laid out in place as (C, vocab), the same values seen as
    (vocab, C), so F.linear reads it as decode.keep_float32_head's copy is read, faster at 1 to 16 rows than over the
    row-major matrix, with no second copy: a tied token table is the same tensor, and an embedding row is a strided
    read. For a model that only decodes (inference_model)."""
    w = model.lm_head.weight
    w.data = w.data.t().contiguous().t()  # (vocab, C), strides (1, vocab)
