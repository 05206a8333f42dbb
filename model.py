"""The GPT language model: a pre-LayerNorm decoder-only transformer in the GPT-2 layout.

Read it in order, the way the model computes: GPTConfig's recipe switches, attention, MLP, Block, KVCache, GPT.
Built on it elsewhere: decoding in core/decoding/, the optimizer in core/training/optim.py, the kernel choices in
core/kernels.py and core/cpu.py (through Kernels and GPT.swap_module). The one arrow back: from_pretrained reaches
core/weights/hf.py from inside the method.

Shapes: B batch, T sequence (queries), Tk keys, C = n_embd, nh heads, hs = C // nh head size.
References: GPT-2 (Radford et al. 2019); "Attention Is All You Need" (Vaswani et al. 2017); nanoGPT (Karpathy),
whose parameter names this file keeps, so GPT-2 weights map one to one.
"""
import contextlib
import functools
import math
import os
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
from torch.nn import functional as F

# The values of GPTConfig's fields that are one of a few named choices (GPTConfig checks them).
CHOICES = {"attn_backend": ("sdpa", "naive"), "gelu_approximate": ("tanh", "none"),
           "pos_embedding": ("learned", "rope"), "norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "relu2", "swiglu"),
           "rope_type": ("default", "llama3")}
# GPT-2's four hub models as GPTConfig fields (nanoGPT's config_args); all have 1024 positions and biases.
GPT2_SHAPES = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257),  # 124M parameters
               "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257),  # 355M
               "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257),  # 774M
               "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257)}  # 1558M
GPT2_HUB_NAMES = tuple(GPT2_SHAPES)


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the model sees: the number of position embeddings
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64, faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2; False is a bit better and faster
    attn_backend: str = "sdpa"  # "sdpa": torch's fused kernel; "naive": the reference below, can return weights
    gelu_approximate: str = "tanh"  # GPT-2 uses GELU's tanh approximation ("gelu_new"); "none" is the exact erf form
    # The modern recipe, one switch each (docs/recipe.md); every default is GPT-2.
    pos_embedding: str = "learned"  # "learned": a wpe table; "rope": rotary q and k (Su et al. 2021), no wpe
    rope_base: float = 10000.0  # RoPE's frequencies are rope_base^(-2i/hs)
    norm: str = "layernorm"  # "rmsnorm": scale only, no mean and no bias (Zhang & Sennrich 2019)
    qk_norm: bool = False  # RMS-normalise q and k per head: bounded scores, stable at high learning rates
    mlp: str = "gelu"  # "relu2": ReLU squared (So et al. 2021); "swiglu": gated, GELU's parameter count (Shazeer 2020)
    n_kv_head: int | None = None  # None: n_head; fewer: grouped-query attention (Ainslie et al. 2023), smaller KV cache
    tie_embeddings: bool = True  # False: the head gets its own matrix
    logit_softcap: float | None = None  # c: logits = c * tanh(logits / c), bounded in (-c, c)
    zero_init_proj: bool = False  # attn.c_proj and mlp.c_proj start at 0: every Block starts as the identity
    unet_skips: bool = False  # the last n_layer // 2 Blocks also read the first half's outputs, mirrored (a U-net)
    value_embeds: int = 0  # k tables: Blocks i and n_layer-k+i (i < k) mix table i's row of each token into v
    norm_eps: float = 1e-5  # every norm's epsilon (LayerNorm, RMSNorm, q/k norm); Qwen3's models use 1e-6
    mlp_hidden: int | None = None  # the MLP's hidden width; None: 4C, or swiglu_hidden(C) for swiglu
    # Shapes of the small open models (docs/interop.md); each default is GPT-2's.
    head_dim: int | None = None  # each head's width hs; None: n_embd // n_head (Qwen3-0.6B: 128, 16 heads, 1024 wide)
    qkv_bias: bool | None = None  # biases on q, k and v; None: as bias. True with bias=False: Qwen2's, no other bias
    rope_type: str = "default"  # "llama3": Llama 3.1's RoPE, its low frequencies slowed (llama3_frequencies)
    rope_factor: float = 8.0  # llama3: long wavelengths are stretched this many times (Llama 3.1: 8, 3.2: 32)
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths past original / this are stretched by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original / this are kept; between, a blend
    rope_original_max_positions: int = 8192  # llama3: "original", the context the model was first trained at

    def __post_init__(self):
        rules = {  # field: (what it must be, a test of its value), checked in this order; type(v) is int: not a bool
            **{name: ("a positive integer", lambda v: type(v) is int and v >= 1)
               for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")},
            **{name: ("a positive integer or None", lambda v: v is None or type(v) is int and v >= 1)
               for name in ("head_dim", "mlp_hidden", "n_kv_head")},
            **{name: (f"one of {allowed}", allowed.__contains__) for name, allowed in CHOICES.items()},
            "dropout": ("in [0, 1)", lambda v: 0 <= v < 1), "rope_base": ("> 1", lambda v: v > 1),
            "logit_softcap": ("positive or None", lambda v: v is None or v > 0),
            "norm_eps": ("in (0, 1)", lambda v: 0 < v < 1),
            "value_embeds": (f"an integer in [0, n_layer // 2] (each table serves a first and a last Block; "
                             f"n_layer={self.n_layer})", lambda v: type(v) is int and 0 <= 2 * v <= self.n_layer),
        }
        for name, (rule, ok) in rules.items():
            if not ok(getattr(self, name)):
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}), or set head_dim")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head}); each "
                             f"key/value head serves n_head // n_kv_head query heads")
        if self.pos_embedding == "rope" and self.head_size % 2:
            raise ValueError(f"rope rotates pairs of channels and needs an even head size, got "
                             f"{self.head_size}; change n_embd, n_head or head_dim")
        factor, low, high, _ = self.rope_llama3 or (1, 0.5, 1, 0)
        if not (factor >= 1 and 0 < low < high):
            raise ValueError(f"rope_type='llama3' needs rope_factor >= 1 and 0 < rope_low_freq_factor < "
                             f"rope_high_freq_factor, got {factor}, {low}, {high}")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def attn_width(self) -> int:
        """The width of all query heads side by side, n_head * hs: n_embd unless head_dim says otherwise."""
        return self.n_head * self.head_size

    @property
    def rope_llama3(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_positions) for rope_type='llama3', else None."""
        llama3 = (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                  self.rope_original_max_positions)
        return llama3 if self.rope_type == "llama3" else None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head


# GPTConfig's fields that size the model or say how it runs; every other field is a recipe switch (train.py's
# config and the transformers checks read this list).
SHAPE_FIELDS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "attn_backend")
RECIPE_SWITCHES = tuple(f.name for f in fields(GPTConfig) if f.name not in SHAPE_FIELDS)


def causal_mask(Tq: int, Tk: int, device=None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j, aligned to the *end*: query i sits at
    position i + (Tk - Tq) and sees keys j <= i + Tk - Tq, as a chunk of new tokens after a cached prefix
    needs. torch's is_causal=True aligns to the start (j <= i); the two agree only when Tq == Tk."""
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(diagonal=Tk - Tq)


def attention_weights(q: torch.Tensor, k: torch.Tensor, causal: bool = False, mask=None) -> torch.Tensor:
    """softmax(q @ k^T / sqrt(hs)) over the keys, (..., Tq, hs) x (..., Tk, hs) -> (..., Tq, Tk); mask (True: may
    attend) defaults to causal_mask when causal."""
    # Dividing by sqrt(hs) keeps the scores at unit variance whatever the head size, so the
    # softmax does not saturate into a one-hot (Vaswani et al. 2017, section 3.2.1).
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., Tq, Tk)
    if causal and mask is None:
        mask = causal_mask(q.size(-2), k.size(-2), q.device)  # (Tq, Tk)
    if mask is None:
        return torch.softmax(scores, dim=-1)
    # -inf *before* the softmax gives masked keys exactly zero weight and renormalises the rest;
    # zeroing after the softmax would leave rows that no longer sum to 1.
    att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    # A row with every key masked (a query before the first key, Tq > Tk) is 0/0 = NaN after the
    # softmax; it attends to nothing, so it gets zero weights and a zero output.
    return att.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False):
    """Reference attention, softmax(q k^T / sqrt(hs)) v, end-aligned: q (..., Tq, hs), k, v (..., Tk, hs) -> q's shape.
    Equals torch's fused kernel in float64 when Tq == Tk (tests/test_model.py); else give torch causal_mask(Tq, Tk)."""
    return attention_weights(q, k, causal) @ v


def rope_angles(positions: torch.Tensor, head_size: int, base: float,
                llama3: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (T, hs), of the rotary angles positions * base^(-2i/hs), i < hs/2: columns i and
    i + hs/2 hold pair i's angle, sin's first half negated (see apply_rope); positions (B, T) give (B, 1, T, hs).
    In float64 where the device has it: an angle stays exact far past block_size, so a key rotated at
    position p scores the same against any later query."""
    dtype = torch.float32 if positions.device.type == "mps" else torch.float64
    inv_freq = base ** -(torch.arange(0, head_size, 2, device=positions.device, dtype=dtype) / head_size)  # (hs/2,)
    if llama3 is not None:
        inv_freq = llama3_frequencies(inv_freq, *llama3)
    angles = positions.to(dtype)[..., None] * inv_freq  # (T, hs/2) or (B, T, hs/2)
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (T, hs) or (B, T, hs) each
    return (cos, sin) if positions.dim() == 1 else (cos[:, None], sin[:, None])  # (B, 1, T, hs): every head


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_max_positions: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (transformers' _compute_llama3_parameters): frequencies of wavelengths past
    original/low_freq_factor are divided by factor; those under original/high_freq_factor (local order) kept;
    the band between a linear blend in original/wavelength."""
    wavelen = 2 * math.pi / inv_freq  # (hs/2,) positions per turn
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original_max_positions / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelen < original_max_positions / high_freq_factor, inv_freq, scaled)  # (hs/2,)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hs/2) of x (B, nh, T, hs) by the angles of rope_angles (T, hs). A rotation by
    angle(p) on q and angle(p') on k leaves q.k depending on p - p' only: relative positions, no table bounding
    the length. (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) is x cos + (x2, x1) (-sin, sin): the halves
    swapped by a roll, the sign in the table, three elementwise passes."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)  # (B, nh, T, hs)


def make_norm(config: GPTConfig) -> nn.Module:
    """The normalisation layer every Block and the final ln_f use: GPT-2's LayerNorm, or RMSNorm."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Kernels:
    """Which of torch's kernels a forward runs, picked per call; the function is the same whatever they pick. This base
    leaves every call to torch; core/kernels.py's DeviceKernels pick per device, set from outside (GPT.use_kernels)."""

    def blocks(self, x: torch.Tensor) -> contextlib.AbstractContextManager:  # around the Blocks of x (B, T, C)
        return contextlib.nullcontext()

    def attention(self, q: torch.Tensor, Tk: int, training: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # around one attention of q (B, nh, T, hs) over Tk keys


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection. With n_kv_head < n_head (grouped-query
    attention) it makes n_head query heads but n_kv_head key/value heads, each shared by n_head // n_kv_head."""

    kernels = Kernels()  # torch's own choice; GPT.use_kernels sets another

    def __init__(self, config: GPTConfig, value_embed: bool = False):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size = config.n_head, config.kv_heads, config.head_size
        self.backend, self.dropout = config.attn_backend, config.dropout
        self.width, kv_dim = config.attn_width, self.n_kv_head * self.head_size  # n_head * hs, nkv * hs
        qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
        self.c_attn = nn.Linear(config.n_embd, self.width + 2 * kv_dim, bias=qkv_bias)
        # qk_norm: the score q.k/sqrt(hs) of unit-RMS q and k is at most sqrt(hs) times the gains.
        self.q_norm = nn.RMSNorm(self.head_size, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_size, eps=config.norm_eps) if config.qk_norm else nn.Identity()
        self.c_proj = nn.Linear(self.width, config.n_embd, bias=config.bias)
        if value_embed:  # v = lambdas[0] v + lambdas[1] ve, learned (modded-nanogpt)
            self.ve_lambdas = nn.Parameter(torch.empty(2))  # set in GPT.init_weights
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv=None, attn_out=None, rope=None, ve=None):
        """x (B, T, C) -> (B, T, C). kv: this layer's part of a KV cache (KVCache.layer): it takes the chunk's keys
        and values and gives back those to attend over, and their mask (None: causal, end-aligned). attn_out: a list
        the naive backend appends this layer's weights (B, nh, T, Tk) to. rope: (cos, sin) of the chunk's positions,
        (T, hs) each. ve: the tokens' value embeddings (B, T, nkv * hs), mixed into v before the cache."""
        B, T, _ = x.size()
        kv_dim = self.n_kv_head * self.head_size
        q, k, v = self.c_attn(x).split([self.width, kv_dim, kv_dim], dim=2)  # (B, T, nh * hs), 2 x (B, T, nkv * hs)
        if ve is not None:
            v = self.ve_lambdas[0] * v + self.ve_lambdas[1] * ve  # (B, T, nkv * hs)
        # Heads are a view: split nh * hs and move nh next to B, so every head is a batch entry.
        q = q.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k, v = (t.view(B, T, self.n_kv_head, self.head_size).transpose(1, 2) for t in (k, v))  # (B, nkv, T, hs)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        attend = self._sdpa if self.backend == "sdpa" else functools.partial(self._naive, attn_out=attn_out)
        if hasattr(kv, "attend"):  # several caches' rows as one (core/decoding/cache.py's Segments): each attends alone
            y = kv.attend(q, k, v, attend)
        else:
            k, v, mask = (k, v, None) if kv is None else kv(k, v)  # (B, nkv, Tk, hs) x 2, mask (B, 1, T, Tk) or None
            y = attend(q, k, v, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, self.width)  # (B, T, nh * hs), heads side by side again
        return self.resid_dropout(self.c_proj(y))  # c_proj mixes what the heads found

    def _sdpa(self, q, k, v, mask=None):
        Tq, Tk = q.size(2), k.size(2)
        dropout_p = self.dropout if self.training else 0.0
        gqa = self.n_kv_head != self.n_head  # torch repeats each k/v head for its group of query heads
        causal = mask is None and Tq == Tk
        if mask is None and not causal:
            # One new token is the last position and sees every key: no mask, which keeps decoding
            # on the fastest kernels. A longer chunk needs the end-aligned mask, see causal_mask.
            mask = None if Tq == 1 else causal_mask(Tq, Tk, q.device)
        # (mask given: the cache's, e.g. rows at their own positions, each row's own causal mask)
        with self.kernels.attention(q, Tk, self.training):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                                  enable_gqa=gqa)  # (B, nh, T, hs)

    def _naive(self, q, k, v, mask=None, attn_out=None):
        group = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, Tk, hs)
        att = attention_weights(q, k, causal=True, mask=mask)  # (B, nh, T, Tk); mask: the cache's (B, 1, T, Tk)
        if attn_out is not None:
            attn_out.append(att)
        return self.attn_dropout(att) @ v  # (B, nh, T, hs)


def swiglu_hidden(n_embd: int) -> int:
    """SwiGLU's hidden width H: its three C x H matrices hold as many weights as GELU's two C x 4C
    when H = 8C/3. Rounded to a multiple of 64 (matmul tiles) when that stays within 1%."""
    exact = 8 * n_embd / 3
    tiled = 64 * round(exact / 64)
    return tiled if tiled and abs(tiled - exact) <= 0.01 * exact else round(exact)


class MLP(nn.Module):
    """Position-wise feed-forward: expand, nonlinearity, project back. "gelu": GPT-2's 4C GELU. "relu2":
    relu(x)^2, as cheap as ReLU and better than GELU at equal size (So et al. 2021). "swiglu": silu(gate) * up,
    both halves from one c_fc, H = swiglu_hidden(C) wide (Shazeer 2020)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        hidden = config.mlp_hidden or (swiglu_hidden(config.n_embd) if self.kind == "swiglu" else 4 * config.n_embd)
        fc_out = 2 * hidden if self.kind == "swiglu" else hidden
        self.c_fc = nn.Linear(config.n_embd, fc_out, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = self.c_fc(x)  # (B, T, 4C), or (B, T, 2H) for swiglu
        if self.kind == "gelu":
            h = self.gelu(h)
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            gate, up = h.chunk(2, dim=-1)  # (B, T, H) each
            h = F.silu(gate) * up
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    """One transformer layer, pre-LN: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)). Normalising each sublayer's
    input, not the residual stream, leaves an identity path from the embeddings to the head, which keeps deep
    stacks trainable without warm-up tricks (GPT-2 section 2.3)."""

    def __init__(self, config: GPTConfig, value_embed: bool = False):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, value_embed)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, kv=None, attn_out=None, rope=None, ve=None):
        x = x + self.attn(self.ln_1(x), kv, attn_out, rope, ve)  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class KVCache:
    """Keys and values of every layer, preallocated for max_len positions, and `pos`, the positions already written.
    GPT.forward asks, in order: keys_seen(T), positions(T), layer(i) in each attention, advance(T), last(x)
    (core/decoding/cache.py's RowCache answers the same for rows each at its own position). `rolling` (rotary only):
    once full, one token at a time overwrites the oldest slot (a sliding window), pos counting on as its position."""

    def __init__(self, n_layer, batch_size, n_head, max_len, head_size, device=None, dtype=torch.float32,
                 rolling=False):
        shape = (n_layer, batch_size, n_head, max_len, head_size)
        self.k, self.v = (torch.zeros(shape, device=device, dtype=dtype) for _ in "kv")  # (L, B, nkv, max_len, hs) each
        self.pos, self.rolling = 0, rolling

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    def keys_seen(self, T: int) -> int:
        """How many keys the last of T new tokens attends to: pos + T, or max_len once a full cache rolls."""
        return self.max_len if self.rolling and T == 1 and self.pos >= self.max_len else self.pos + T

    def positions(self, T: int, device) -> torch.Tensor:  # the chunk's, (T,)
        return torch.arange(self.pos, self.pos + T, device=device)

    def layer(self, i: int):  # layer i's part, as its attention calls it: see write
        return functools.partial(self.write, self.k[i], self.v[i], self.pos)

    @staticmethod
    def write(k_cache, v_cache, pos: int, k, v):
        """k, v (B, nkv, T, hs) go to [pos:pos+T] of a layer's buffers -> (keys, values, mask) to attend over:
        [0:pos+T], causal (mask None: CausalSelfAttention aligns it to the end)."""
        T, max_len = k.size(2), k_cache.size(2)
        if pos + T > max_len:
            # A full rolling cache (rotary positions, one token at a time): the new key replaces the oldest. Attention
            # sums over keys in any order and a rotary key carries its own position, so the slots need no reordering.
            k_cache[:, :, pos % max_len], v_cache[:, :, pos % max_len] = k[:, :, 0], v[:, :, 0]
            return k_cache, v_cache, None  # (B, nkv, max_len, hs) x 2
        k_cache[:, :, pos:pos + T], v_cache[:, :, pos:pos + T] = k, v
        return k_cache[:, :, :pos + T], v_cache[:, :, :pos + T], None  # (B, nkv, pos+T, hs) x 2

    def advance(self, T: int):
        self.pos += T

    def last(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, 1, C): the position last_only reads
        return x[:, -1:]

    def reset(self):  # the buffers are reused from position 0
        self.pos = 0


class GPT(nn.Module):
    """GPT-2: token + position embeddings -> n_layer Blocks -> LayerNorm -> vocabulary head. The recipe switches
    change one piece each: rotary positions, RMSNorm, q/k norm, the MLP, fewer k/v heads, an untied head, ..."""

    kernels = Kernels()  # torch's own choice; use_kernels sets another

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            **({"wpe": nn.Embedding(config.block_size, config.n_embd)} if config.pos_embedding == "learned" else {}),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, self.value_embed_table(i) is not None) for i in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        if config.value_embeds:  # token value embeddings (modded-nanogpt), one row of nkv * hs per token
            self.transformer["ve"] = nn.ModuleList(nn.Embedding(config.vocab_size, config.kv_heads * config.head_size)
                                                   for _ in range(config.value_embeds))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # Weight tying (Press & Wolf 2017, as GPT-2): a token's score is its embedding's similarity.
            self.lm_head.weight = self.transformer.wte.weight
        if config.unet_skips:  # one learned weight per skip connection (modded-nanogpt)
            self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2))
        self.swapped_numel = 0  # weights that modules swapped in (swap_module) hold outside parameters()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2's initialisation, the one place weights get their starting values: Linear and embedding weights
        ~ N(0, 0.02), biases 0, norms the identity. The two projections per block that add into the residual
        stream (attn.c_proj, mlp.c_proj) get std 0.02 / sqrt(2 * n_layer): the stream is a sum of 2 * n_layer
        such terms, and this keeps its variance from growing with depth (GPT-2 section 2.3)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
        # zero_init_proj (modded-nanogpt): the projections start at 0, every Block adds nothing, and the first
        # step trains a bigram model; c_fc and c_attn get gradients once c_proj has moved off 0.
        residual_std = 0.0 if self.config.zero_init_proj else 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)
            if hasattr(block.attn, "ve_lambdas"):
                nn.init.constant_(block.attn.ve_lambdas, 0.5)
        if self.config.unet_skips:
            nn.init.ones_(self.skip_weights)

    def use_kernels(self, kernels: Kernels) -> None:
        """Run every forward with kernels' choices (core/kernels.py's DeviceKernels): this model and its attention."""
        for module in self.modules():  # this model among them
            if isinstance(module, (GPT, CausalSelfAttention)):
                module.kernels = kernels

    def swap_module(self, name: str, module: nn.Module) -> None:
        """Put module where the submodule `name` is ("lm_head", "transformer.h.0.mlp.c_fc"): a home's own kernel for
        it (packed, quantized, a float32 copy) in a model that only decodes; get_num_params still counts its weights."""
        before = sum(p.numel() for p in self.parameters())  # shared tensors once
        self.set_submodule(name, module)
        self.swapped_numel += before - sum(p.numel() for p in self.parameters())

    def value_embed_table(self, i: int) -> int | None:
        """Which value-embedding table Block i reads: j for Blocks j and L-k+j (j < k = value_embeds), else None:
        the first and the last Blocks, as in modded-nanogpt."""
        k, L = self.config.value_embeds, self.config.n_layer
        return i if i < k else i - (L - k) if i >= L - k else None

    def forward(self, idx, targets=None, kv_cache=None, return_attn=False, last_only=False):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss or None). targets (B, T): next-token ids, the loss
        their mean cross-entropy (-1 ignored). kv_cache: idx continues after the tokens already in it (KVCache).
        last_only (generation): the logits (B, 1, vocab) of the position kv_cache.last names (the last one) in
        float32. return_attn (naive backend): also the weights (n_layer, B, nh, T, Tk)."""
        (B, T), c = idx.size(), self.config
        self._check_input(B, T, kv_cache, return_attn)
        positions = torch.arange(T, device=idx.device) if kv_cache is None else kv_cache.positions(T, idx.device)
        x, rope = self.transformer.wte(idx), None  # (B, T, C)
        if c.pos_embedding == "learned":
            x = x + self.transformer.wpe(positions)
        else:
            rope = rope_angles(positions, c.head_size, c.rope_base, c.rope_llama3)  # 2 x (T, hs), or (B, 1, T, hs)
        x = self.transformer.drop(x)
        attn = [] if return_attn else None
        with self.kernels.blocks(x):
            x = self._blocks(x, kv_cache, attn, rope, idx)  # (B, T, C)
        if kv_cache is not None:
            kv_cache.advance(T)
        if last_only:
            return self._last_logits(x[:, -1:] if kv_cache is None else kv_cache.last(x)), None
        logits = self._softcap(self.lm_head(self.transformer.ln_f(x)))  # (B, T, vocab)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                                            ignore_index=-1)
        return (logits, loss, torch.stack(attn)) if return_attn else (logits, loss)

    def _blocks(self, x, kv_cache, attn, rope, idx):
        """x (B, T, C) through every Block. unet_skips: Block L-1-j also gets Block j's output (j < L // 2) times a
        learned weight, as a U-net's decoder sees its encoder's (modded-nanogpt). value_embeds: the Blocks
        value_embed_table names get their table's rows of the tokens idx (B, T)."""
        L = self.config.n_layer
        half = L // 2 if self.config.unet_skips else 0
        skips = []  # the first half's outputs, read back last-in first-out
        ves = [table(idx) for table in self.transformer.ve] if self.config.value_embeds else []  # (B, T, nkv * hs)
        for i, block in enumerate(self.transformer.h):
            if i >= L - half:
                x = x + self.skip_weights[i - (L - half)] * skips.pop()
            j = self.value_embed_table(i)
            x = block(x, None if kv_cache is None else kv_cache.layer(i), attn, rope,
                      None if j is None else ves[j])  # (B, T, C)
            if i < half:
                skips.append(x)
        return x

    def _last_logits(self, x):
        """x (B, 1, C) -> logits (B, 1, vocab): the head (the largest matmul at small T) on one position, as nanoGPT's;
        in float32 whatever the weights or autocast (a swapped-in head gets float32 input), since bfloat16's 8-bit
        mantissa ties close scores in greedy and top-k."""
        h = self.transformer.ln_f(x).float()  # (B, 1, C)
        with torch.autocast(h.device.type, enabled=False):
            if isinstance(self.lm_head, nn.Linear):
                return self._softcap(F.linear(h, self.lm_head.weight.float()))  # (B, 1, vocab)
            return self._softcap(self.lm_head(h))  # (B, 1, vocab)

    def _softcap(self, logits):
        """c * tanh(logits / c), c = logit_softcap (Gemma 2): no token can become arbitrarily confident."""
        c = self.config.logit_softcap
        return logits if c is None else c * torch.tanh(logits / c)

    def _check_input(self, B, T, kv_cache, return_attn) -> None:
        """A ValueError of one line if the model (or kv_cache) cannot take a chunk of B rows, T tokens."""
        seen = T if kv_cache is None else kv_cache.keys_seen(T)  # keys the last query attends to
        if seen > self.config.block_size:
            raise ValueError(f"sequence of {seen} tokens exceeds block_size {self.config.block_size}")
        if kv_cache is not None and B != kv_cache.batch_size:
            raise ValueError(f"batch of {B} rows fed to a KV cache made for {kv_cache.batch_size}")
        if kv_cache is not None and seen > kv_cache.max_len:
            raise ValueError(f"KV cache holds {kv_cache.max_len} positions; {seen - T} used, {T} more do not fit")
        if return_attn and self.config.attn_backend != "naive":
            raise ValueError("return_attn needs attn_backend='naive' (the fused sdpa kernel never forms the weights)")

    def new_kv_cache(self, batch_size, max_len=None, dtype=None) -> KVCache:
        """An empty KVCache for this model, on its device; max_len defaults to block_size, dtype to the keys'
        (autocast's when autocast is on, else the weights')."""
        weight = self.transformer.wte.weight
        if dtype is None and torch.is_autocast_enabled(weight.device.type):
            dtype = torch.get_autocast_dtype(weight.device.type)
        c = self.config
        return KVCache(c.n_layer, batch_size, c.kv_heads, max_len or c.block_size, c.head_size,
                       device=weight.device, dtype=dtype or weight.dtype, rolling=c.pos_embedding == "rope")

    def get_num_params(self, non_embedding=True) -> int:
        """Parameter count, the tied wte/lm_head matrix once. non_embedding=True leaves out the position embeddings
        (nanoGPT's convention: the token embeddings stay in, since they are also the head's weights)."""
        n = sum(p.numel() for p in self.parameters()) + self.swapped_numel  # swap_module's, held outside parameters()
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls with weights (2 forward, 4 backward) plus
        12 * L * H * Q * T for attention over the block (PaLM, Chowdhery et al. 2022, appendix B)."""
        c = self.config
        return 6 * self.get_num_params() + 12 * c.n_layer * c.n_head * c.head_size * c.block_size

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops) -> float:
        """Model FLOPs utilisation: the fraction of peak_flops (the device's FLOP/s) that fwdbwd_per_iter forward
        and backward passes of block_size tokens in dt seconds achieve."""
        if dt <= 0 or peak_flops <= 0:
            raise ValueError(f"dt and peak_flops must be positive, got {dt} and {peak_flops}")
        return self.flops_per_token() * self.config.block_size * fwdbwd_per_iter / dt / peak_flops

    def crop_block_size(self, block_size):
        """Shrink the context to block_size, e.g. to fine-tune GPT-2 (1024) with a shorter one."""
        if not 1 <= block_size <= self.config.block_size:
            raise ValueError(f"block_size must be in [1, {self.config.block_size}], got {block_size}")
        self.config = replace(self.config, block_size=block_size)
        if "wpe" in self.transformer:  # rotary positions have no table to crop
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())

    @torch.no_grad()
    def grow_vocab(self, vocab_size):
        """Add rows to the embedding (and an untied head) for new token ids (a chat fine-tune's turn markers), each
        the mean of the others as transformers' resize_token_embeddings does: an average token and an average
        logit, not a random row that can dominate or vanish from the softmax before it is learned."""
        old = self.config.vocab_size
        if vocab_size < old:
            raise ValueError(f"grow_vocab cannot shrink the vocabulary from {old} to {vocab_size}")
        if not isinstance(self.lm_head, nn.Linear):  # a module swapped in for decoding (swap_module)
            raise ValueError(f"grow_vocab needs the head to be an nn.Linear, not a {type(self.lm_head).__name__}: "
                             "grow the vocabulary before a module is swapped in for decoding")

        def grown(weight):  # (old, C) -> (vocab_size, C)
            return nn.Parameter(torch.cat([weight, weight.mean(0, keepdim=True).expand(vocab_size - old, -1)]))

        self.transformer.wte.weight = grown(self.transformer.wte.weight)
        self.lm_head.weight = (self.transformer.wte.weight if self.config.tie_embeddings
                               else grown(self.lm_head.weight))
        self.transformer.wte.num_embeddings = self.lm_head.out_features = vocab_size
        self.config = replace(self.config, vocab_size=vocab_size)

    @classmethod
    def from_pretrained(cls, name_or_dir, override_args=None) -> "GPT":
        """Outside weights: GPT-2 from the hub (gpt2, gpt2-medium, gpt2-large, gpt2-xl), or a folder written by
        transformers' save_pretrained or export.py, of any architecture core/weights/hf.py maps (GPT-2, Llama,
        Qwen3, Arcee, Nemotron). Needs transformers. override_args may set dropout and attn_backend."""
        # The one import circle: core/weights/hf.py imports this file at its top, and nanoGPT's users call this.
        from core.weights import hf
        if os.path.isdir(name_or_dir):
            return hf.from_folder(name_or_dir, override_args)
        return hf.from_hub(name_or_dir, override_args)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """nanoGPT's: idx (B, T) -> (B, T + max_new_tokens), each token drawn with torch's global RNG from
        softmax(logits / temperature) cut to the top_k (temperature 0: greedy). Call model.eval() first. A KV cache
        while the context fits, then a whole forward per token as in nanoGPT; core/decoding/decode.py's is faster."""
        block_size = self.config.block_size
        cache = self.new_kv_cache(idx.size(0), min(block_size, idx.size(1) + max_new_tokens))
        for _ in range(max_new_tokens):
            if idx.size(1) > block_size:  # every position moved: nanoGPT's crop, no cache
                logits = self(idx[:, -block_size:], last_only=True)[0][:, -1, :]  # (B, vocab)
            else:
                logits = self(idx[:, cache.pos:], kv_cache=cache, last_only=True)[0][:, -1, :]
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    def decay_groups(self, weight_decay, leave_out=()):
        """nanoGPT's two AdamW groups: the >= 2-D weights (matrices, embeddings) decayed by weight_decay, the rest
        (biases, gains, which set scales and offsets rather than store features) not; in parameters() order, which
        saved optimizer state is matched by. leave_out: ids of parameters another optimizer takes (Muon's)."""
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in leave_out]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """nanoGPT's: a torch AdamW over decay_groups, fused (one kernel for every tensor) on CUDA and CPU, where the
        per-tensor loop is the slower (docs/performance.md, the loop section)."""
        return torch.optim.AdamW(self.decay_groups(weight_decay), lr=learning_rate, betas=betas,
                                 fused=device_type in ("cuda", "cpu"))
