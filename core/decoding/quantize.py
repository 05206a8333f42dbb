"""Quantized decoding on a CPU: the Blocks' matrices and the head read as int8 or int4.

    model = inference_model(model, rt, quantize="int8")   # sample.py, eval.py, serve.py: --quantize=int8

Decoding at a few rows is bound by reading the weights, so weights stored in fewer bytes decode faster:
int8 reads a quarter of float32's bytes, int4 an eighth.

    int8   weights per output channel, symmetric: w[n, k] ~ q[n, k] * scale[n], scale[n] = max_k |w[n, k]| / 127;
           activations quantized as each product runs, to 7 bits over each row's own range (its min and max,
           zero included), and the integer product summed in int32: torch's own dynamic int8 linear
           (quantized::linear_dynamic, FBGEMM); CTranslate2's int8 quantizes activations too
    int4   weights only, in groups of INT4_GROUP_SIZE along the input, asymmetric: w[n, k] ~ (q[n, k] - 8) * scale
           + zero with q in 0..15 and scale, zero for the group (torch._weight_int4pack_mm_for_cpu, the layout
           llama.cpp's Q4_1 and torchao's int4 weight-only use); the product runs in bfloat16

Why int8 quantizes the activations too: torch's int8 weight-only kernel (torch._weight_int8pack_mm, with
bfloat16 activations) reads the weights at half the rate of FBGEMM's integer product at one row, or less,
and gains little from a batch (docs/performance.md, "peers"). 7 bits, not 8: on a CPU without VNNI, FBGEMM
sums pairs of uint8 x int8 products in int16, which 8-bit activations can overflow; the same 7 bits everywhere
keep the results alike on every CPU. FBGEMM rounds an input of several rows on one range;
QuantizedLinear.rows_quantized rounds each row on its own, so that a request's tokens do not depend on the
requests batched beside it.

The products go through torch's quantized engine, FBGEMM on x86; on ARM torch picks QNNPACK, which rounds
activations to 8 bits and was never measured here.

What stays as it was: the token and position embeddings (a tied head gets its own quantized copy, the
table stays float), the norms and attention itself. torchao is not a dependency: its int8 configs
(weight-only, and with dynamic activations) decoded slower than these kernels, eager or compiled
(docs/lab-notes.md). The speed beside CTranslate2's and llama.cpp's is in docs/performance.md
("peers"), the quality in docs/evaluation.md ("Quantized weights").
"""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.errors import UserError
from model import GPT

KINDS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32  # input columns per int4 scale and zero: llama.cpp's Q4 block (docs/evaluation.md)
ACTIVATIONS = torch.bfloat16  # int4's CPU kernel is fast only in bf16: float32 is 10-100x slower
INT8_REDUCE_RANGE = True  # 7-bit activations: see the docstring
INT8_LEVELS = 127  # the activations' highest level under INT8_REDUCE_RANGE
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs output rows by 16: the head is padded to it


def check_quantize(kind: str, training: bool = False, device: str = "cpu") -> None:
    """The one check of --quantize: a UserError of one line if kind is unknown, the model trains, or the
    device is not the CPU (the kernels used are torch's CPU ones)."""
    if kind not in KINDS:
        raise UserError(f"--quantize must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "none":
        return
    if training:
        raise UserError(f"--quantize={kind} is for decoding only: a model that trains keeps its float weights; "
                        "quantize when sampling, evaluating or serving")
    if torch.device(device).type != "cpu":
        raise UserError(f"--quantize={kind} runs on the CPU only (torch's CPU kernels), not on {device}: "
                        "pass --device=cpu, or --quantize=none")


def quantized_note(kind: str) -> str:
    """What a script's first line adds for kind: ", int8 weights", or nothing."""
    return "" if kind == "none" else f", {kind} weights"


def quantize(model: GPT, kind: str) -> GPT:
    """Swap, in place, every nn.Linear in model's Blocks and its head for a QuantizedLinear of `kind`, once,
    for a model that only decodes (eval mode, on the CPU); the embeddings and norms stay. Returns model."""
    check_quantize(kind, model.training, model.transformer.wte.weight.device)
    if kind == "none":
        return model
    for name, module in [*model.transformer.h.named_modules(prefix="transformer.h"), ("lm_head", model.lm_head)]:
        if isinstance(module, nn.Linear):
            model.swap_module(name, QuantizedLinear(module, kind, name))
    return model


class QuantizedLinear(nn.Module):
    """An nn.Linear whose weight lives only as int8 or int4 values and scales (quantize); x's dtype in and out."""

    def __init__(self, linear: nn.Linear, kind: str, name: str = "linear"):
        super().__init__()
        self.in_features, self.out_features, self.kind = linear.in_features, linear.out_features, kind
        w = linear.weight.detach().float()  # (out, in)
        self.bias = linear.bias if kind != "int8" else None  # int8's is added inside FBGEMM's product
        if kind == "int8":
            bias = None if linear.bias is None else linear.bias.detach().float()
            q, scales = int8_per_channel(w)
            self.packed = int8_packed(q, scales, bias)
            self.weight_bytes = q.numel() + 4 * self.out_features * (1 + (bias is not None))  # what a product reads
            # for rows_quantized: the bias or 0 (out,), each output's sum of dequantized weights (out,), and a row
            # holding 0 and INT8_LEVELS, which fixes the range FBGEMM sees to 0..INT8_LEVELS (scale 1, zero point 0)
            self.register_buffer("bias_or_0", torch.zeros(self.out_features) if bias is None else bias)
            self.register_buffer("weight_sums", (q.float() * scales[:, None]).sum(1))
            self.register_buffer("levels_row", F.pad(torch.tensor([[float(INT8_LEVELS)]]), (0, self.in_features - 1)))
        else:
            if self.in_features % INT4_GROUP_SIZE:
                raise UserError(f"--quantize={kind} needs each matrix's input width to be a multiple of "
                                f"{INT4_GROUP_SIZE}; {name} takes {self.in_features}: use --quantize=none for "
                                "this model")
            w = F.pad(w, (0, 0, 0, -w.size(0) % INT4_N_MULTIPLE))  # zero rows to a multiple of 16, sliced off
            q, scales_and_zeros = int4_groupwise(w, INT4_GROUP_SIZE)
            self.register_buffer("q", torch._convert_weight_to_int4pack_for_cpu(q, 1))  # (out16, in / 2) uint8
            self.register_buffer("scales", scales_and_zeros.to(ACTIVATIONS))  # (in / group, out16, 2)
            self.weight_bytes = q.numel() // 2 + 2 * self.scales.numel()

    def forward(self, x):  # (..., in) -> (..., out)
        if self.kind == "int8" and x.numel() == self.in_features:  # one row: FBGEMM's product alone, bias included
            y = torch.ops.quantized.linear_dynamic(x if x.dtype == torch.float32 else x.float(), self.packed,
                                                   INT8_REDUCE_RANGE)  # (..., out), float32
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if self.kind == "int8":
            y = self.rows_quantized(x2.float())  # (M, out)
        else:
            x2 = x2.to(self.scales.dtype)
            y = torch._weight_int4pack_mm_for_cpu(x2, self.q, INT4_GROUP_SIZE, self.scales)[:, :self.out_features]
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def rows_quantized(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) float32 -> (M, out) float32, each row's activations rounded on that row's own range, as FBGEMM
        rounds a row that comes alone (min and max with zero in, 7 bits): a row's result does not depend on the
        rows beside it. FBGEMM is handed the rounded integers themselves, with levels_row fixing its range to
        0..INT8_LEVELS, so its own rounding keeps them as they are and its product is scales[n] * sum_k xq wq."""
        lo, hi = torch.aminmax(x, dim=1, keepdim=True)  # (M, 1)
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # zero in the range
        step = ((hi - lo) / INT8_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
        zero = torch.round(-lo / step)  # (M, 1): the level of 0.0
        xq = torch.round(x / step).add_(zero).clamp_(0, INT8_LEVELS)  # (M, in): integers
        y = torch.ops.quantized.linear_dynamic(torch.cat([xq, self.levels_row]), self.packed, INT8_REDUCE_RANGE)
        # y[m] = scales * sum_k xq[m, k] q[:, k] + bias; x[m, k] ~ (xq[m, k] - zero[m]) * step[m]
        return (y[:-1] - torch.addcmul(self.bias_or_0, zero, self.weight_sums)) * step + self.bias_or_0

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float -> q (out, in) int8 in -127..127 and scales (out,) float32 with w ~ q * scales[:, None]."""
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def int8_packed(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """q (out, in) int8 and scales (out,) -> FBGEMM's packed weight for quantized::linear_dynamic. torch 2.13
    warns that its quantized tensors (the one way in) are deprecated; the warning is kept out of every run's
    output here, and tests/test_quantize.py fails on the torch that removes them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
        qw = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qw, bias)


def int4_groupwise(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float -> q (out, in) int32 in 0..15 and scales_and_zeros (in / group, out, 2) float32, the layout
    torch's int4pack kernels take: w[n, k] ~ (q[n, k] - 8) * scale + zero for k's group, scale = (max - min) / 15
    and zero = min + 8 * scale over the group's `group` weights of row n."""
    N, K = w.shape
    wg = w.view(N, K // group, group)  # (out, groups, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # (out, groups)
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(ACTIVATIONS).float()
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
    zero = (lo + 8 * scale).to(ACTIVATIONS).float()
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # (groups, out, 2)
