"""The optimizer: AdamW, or Muon for the hidden matrices with AdamW for the rest; the parameter groups' one home.

    optimizer = build_optimizer(model, "muon", adamw_lr=1e-3, muon_lr=0.02, ...)
    set_lr(optimizer, get_lr(it, cfg) / cfg.learning_rate)   # the schedule scales every group's own lr

Muon (Jordan et al. 2024) orthogonalises each 2-D update (Newton-Schulz), so every direction of a matrix moves at
the same rate: for hidden matrices only. The embedding and head are lookups (one row per token), gains and biases
vectors: those stay on AdamW, as in modded-nanogpt and nanochat.
"""
import contextlib
import math

import torch
import torch.nn as nn
from torch.optim._muon import _adjust_lr  # the rate scaled to the matrix's shape, as torch's own step scales it

from core.errors import UserError
from core.runtime import native_bf16

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
# Newton-Schulz's polynomials: torch's one quintic at every step, or Polar Express's one per step (Amsel et al. 2025),
# fitted to where the spectrum stands after the steps before (docs/recipe.md, muon_ns_coefficients).
NS_COEFFICIENTS = ("quintic", "polar_express")
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
POLAR_EXPRESS_SAFETY = 1.02  # the schedule starts from X / (1.02 |X|_F): spectra a little inside [0, 1]


class MultiOptimizer:
    """Several torch optimizers stepped as one: the loop, GradScaler (through param_groups) and checkpoints (each
    optimizer's state under its name) see one object."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.optimizers):
            raise UserError(f"the checkpoint holds optimizer state for {sorted(state)}, this run builds "
                            f"{sorted(self.optimizers)}; resume with the optimizer the run started with")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def torch_optimizers(optimizer) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers inside `optimizer`: torch.distributed.checkpoint cannot see into a MultiOptimizer."""
    return tuple(optimizer.optimizers.values()) if isinstance(optimizer, MultiOptimizer) else (optimizer,)


def hidden_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Muon's matrices, by name: the weights of the Linear layers inside transformer.h. The rest (embeddings, an
    untied head, gains, biases) is AdamW's (GPT.decay_groups)."""
    hidden = {id(m.weight) for block in model.transformer.h for m in block.modules() if isinstance(m, nn.Linear)}
    return [(name, p) for name, p in model.named_parameters() if id(p) in hidden and p.requires_grad]


def check_muon_params(named: list[tuple[str, nn.Parameter]]) -> None:
    """Muon orthogonalises matrices; anything else is a one-line error naming the parameter."""
    for name, p in named:
        if p.dim() != 2:
            raise UserError(f"optimizer=muon takes only 2-D matrices, but {name} has shape {tuple(p.shape)}; "
                            f"give it to AdamW (core/training/optim.py hidden_matrices) or use optimizer=adamw")


def build_optimizer(model: nn.Module, optimizer: str, adamw_lr: float, weight_decay: float,
                    betas: tuple[float, float], device_type: str, muon_lr: float = 0.02,
                    muon_momentum: float = 0.95, muon_weight_decay: float = 0.0, muon_ns_steps: int = 5,
                    muon_ns_coefficients: str = "quintic"):
    """AdamW over GPT.decay_groups, or Muon + AdamW (a MultiOptimizer of "muon" and "adamw"). Every group
    records its own peak learning rate as "base_lr"; set_lr scales them all by the schedule."""
    if optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    hidden = hidden_matrices(model) if optimizer == "muon" else []
    adamw_groups = [g | {"base_lr": adamw_lr} for g in model.decay_groups(weight_decay, {id(p) for _, p in hidden})]
    adamw = torch.optim.AdamW(adamw_groups, lr=adamw_lr, betas=betas, fused=device_type in ("cuda", "cpu"))  # as GPT's
    if optimizer == "adamw":
        return adamw
    check_muon_params(hidden)
    # Newton-Schulz in bf16 where the device computes it natively (CUDA sm80+, CPUs with AVX512-BF16/AMX or ARM
    # BF16), float32 where bf16 would be emulated (most laptop and desktop CPUs).
    extra = {"ns_dtype": torch.bfloat16 if native_bf16(device_type) else torch.float32}
    if muon_ns_coefficients != "quintic":
        extra["ns_coefficients"] = ns_schedule(muon_ns_coefficients, muon_ns_steps)
    # adjust_lr_fn="original": lr * sqrt(max(1, rows / cols)), Keller Jordan's scaling, so muon_lr
    # is the rate of a square matrix whatever the layer's aspect ratio.
    muon = BatchedMuon([{"params": [p for _, p in hidden], "base_lr": muon_lr}], lr=muon_lr, momentum=muon_momentum,
                      weight_decay=muon_weight_decay, adjust_lr_fn="original", ns_steps=muon_ns_steps, **extra)
    return MultiOptimizer({"muon": muon, "adamw": adamw})


def ns_schedule(kind: str, steps: int) -> tuple[tuple[float, float, float], ...]:
    """polar_express's first `steps` polynomials, one (a, b, c) per step, its safety factor folded into the first:
    p(x / s) = (a / s) x + (b / s³) x³ + (c / s⁵) x⁵, so the iteration keeps Muon's X / |X|_F start."""
    if kind != "polar_express" or not 1 <= steps <= len(POLAR_EXPRESS):
        raise UserError(f"muon_ns_coefficients=polar_express holds {len(POLAR_EXPRESS)} steps' polynomials, got "
                        f"muon_ns_coefficients={kind}, muon_ns_steps={steps}; set muon_ns_steps to 1..{len(POLAR_EXPRESS)}")
    (a, b, c), s = POLAR_EXPRESS[0], POLAR_EXPRESS_SAFETY
    return ((a / s, b / s ** 3, c / s ** 5),) + POLAR_EXPRESS[1:steps]


def newton_schulz(grad: torch.Tensor, coefficients, steps: int,
                  eps: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Muon's orthogonalisation of a 2-D update or a batch (k, m, n): X <- a X + (b A + c A²) X, A = X Xᵀ, in `dtype`
    (torch's: bfloat16 always); coefficients one (a, b, c) or one per step. A wide matrix takes gram_newton_schulz in
    float32/64 only: in bfloat16 the Gram matrix's powers lose the small singular values (relative error 2.1 against
    the loop's 0.08 on a decaying spectrum). DTensor shards take the loop, whose matmuls gather as torch's do."""
    schedule = tuple(coefficients)[:steps] if isinstance(coefficients[0], (tuple, list)) else (coefficients,) * steps
    if len(schedule) < steps:
        raise ValueError(f"a Newton-Schulz schedule of {len(schedule)} polynomials cannot run {steps} steps")
    x = grad.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT  # iterate on the wide orientation: the Gram matrix x @ x.T is the smaller one
    # Each matrix over its Frobenius norm, >= its spectral norm: every spectrum lies in [0, 1].
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    if x.size(-1) > 1.5 * x.size(-2) and dtype in (torch.float32, torch.float64) and type(x) is torch.Tensor:
        x = gram_newton_schulz(x, schedule)
    else:
        addmm = torch.addmm if x.dim() == 2 else torch.baddbmm  # the same call, one matrix or a batch
        for a, b, c in schedule:
            gram = x @ x.mT
            x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b A + c A²) x
    return x.mT if tall else x


def gram_newton_schulz(x: torch.Tensor, schedule: tuple[tuple[float, float, float], ...]) -> torch.Tensor:
    """The Newton-Schulz iterates of x (m, n) or (k, m, n), m <= n, through the Gram matrix G = x xᵀ (m, m), step
    k's polynomial schedule[k] = (a, b, c). Each iterate is X_k = Q_k x with Q_k a polynomial in G, so
    A_k = X_k X_kᵀ and the step's P_k = a I + b A_k + c A_k² all commute: Q_{k+1} = P_k Q_k and
    A_{k+1} = P_k A_k P_k. The loop costs steps x (4m²n + 2m³) FLOPs; this costs 4m²n + (4 steps - 3) x 2m³, less
    whenever n > 1.5 m (config/modern.py's quick start: 37% less Newton-Schulz, tests/test_recipe.py). It equals
    the loop to 1e-12 in float64; in float32 it is within 1e-4 of exact (the loop: 4e-5; bfloat16: 1e-2 to 8e-2)."""
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm
    gram = x @ x.mT  # A_0 (m, m)
    q, steps = None, len(schedule)
    for k, (a, b, c) in enumerate(schedule):
        poly = addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A²
        if q is None:
            q = poly + a * torch.eye(gram.size(-1), dtype=gram.dtype, device=gram.device)  # Q_1 = P_0
        else:
            q = addmm(q, poly, q, beta=a)  # P Q = a Q + (b A + c A²) Q
        if k < steps - 1:
            ap = addmm(gram, gram, poly, beta=a)  # A P
            gram = addmm(ap, poly, ap, beta=a)  # P A P = a (A P) + (b A + c A²)(A P)
    return q @ x  # (m, n)


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon with Newton-Schulz in `ns_dtype` (torch's is always bfloat16, the whole cost of a step where
    emulated: docs/lab-notes.md, Muon) and each shape's updates as one batch: torch's _single_tensor_muon line for
    line otherwise, with torch's state and param_groups, so checkpoints move between the two (tests/test_recipe.py)."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype  # not in defaults: the state_dict stays torch's

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            updates = {}  # shape -> [(param, momentum update)]: one batch per shape (a layer's matrices)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                updates.setdefault(p.shape if type(update) is torch.Tensor else id(p), []).append((p, update))
            args = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
            for batch in updates.values():
                params, ups = zip(*batch)
                # One batched matmul per Newton-Schulz step for all k, which two cores share where k small ones
                # mostly wait on each other (docs/lab-notes.md, Muon's step alone). A DTensor shard: alone.
                orthogonal = (newton_schulz(torch.stack(ups), *args).unbind(0) if type(ups[0]) is torch.Tensor
                              else [newton_schulz(u, *args) for u in ups])
                for p, update in zip(params, orthogonal):
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def load_state(optimizer, state: dict) -> None:
    with restoring(optimizer, "muon" if set(state) == {"muon", "adamw"} else "adamw"):
        optimizer.load_state_dict(state)


RESUME_KEEPS = ("base_lr", "ns_steps", "ns_coefficients")  # group settings a resume takes from its config


@contextlib.contextmanager
def restoring(optimizer, saved_kind: str):
    """Around any load of a checkpoint's state into `optimizer`: the kinds must match, and RESUME_KEEPS stay this
    run's (a load brings back the saved groups'), so a resume may change the rates and Newton-Schulz settings."""
    kind = "muon" if isinstance(optimizer, MultiOptimizer) else "adamw"
    if saved_kind != kind:
        raise UserError(f"the checkpoint was trained with optimizer={saved_kind}, this run uses optimizer={kind}; "
                        f"resume with --optimizer={saved_kind}, or start a new out_dir")
    configured = [{k: g[k] for k in RESUME_KEEPS if k in g} for g in optimizer.param_groups]
    yield
    for group, keep in zip(optimizer.param_groups, configured):
        group.update(keep)


def set_lr(optimizer, scale: float) -> None:
    """Set every group's learning rate to scale * its base_lr (scale: the schedule, 1 at the peak)."""
    for group in optimizer.param_groups:
        group["lr"] = scale * group["base_lr"]


def lr_at(it: int, peak: float, min_lr: float, warmup_iters: int, decay_iters: int, schedule: str = "cosine",
          cooldown_frac: float = 0.2) -> float:
    """Linear warmup, then down to min_lr at decay_iters: "cosine" (nanoGPT) a half cosine over the whole decay, "wsd"
    (warmup-stable-decay, Hu et al. 2024 "MiniCPM") the peak until the last cooldown_frac, then a straight line: the
    loss falls fastest while the rate comes down, and the stable phase keeps the rate high for longer first."""
    if it < warmup_iters:
        return peak * (it + 1) / (warmup_iters + 1)
    if it >= decay_iters:
        return min_lr
    if schedule == "wsd":
        start = max(warmup_iters, decay_iters - round(cooldown_frac * decay_iters))  # first iteration of the decay
        ratio = max(0, it - start) / max(1, decay_iters - start)  # 0 -> 1
        return peak + ratio * (min_lr - peak)
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (peak - min_lr)
