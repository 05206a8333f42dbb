"""Decoding: a trained model as it generates, on any device.

    model, steps = inference_model(model, rt)                        # eval, weights cast once, CPU layouts
    out = generate(model, idx, 100, temperature=0.8, top_k=200, steps=steps)      # (B, T + 100)
    for token in generate_stream(model, idx, 100, Sampling(...), steps):          # (B, 1) each, as soon as drawn

Read in order: how a token is drawn (sample_next: temperature, top-k, top-p; the exponential race that lets rows
of many generators share one call), the one check of those settings, the context window's rule past block_size
(slide_window, window_shift), the loop itself, then the model as it decodes (inference_model). The server's
engine (core/serving/engine.py), chat replies (core/decoding/replies.py), sample.py and the benchmarks all decode
through these.
"""
import platform
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from core import cpu, kernels
from core.decoding import quantize as quantization
from core.decoding.cache import StaticCache
from core.runtime import Runtime
from model import GPT


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    """Pick the next token for each row of logits (B, vocab) -> (B, 1).

    temperature == 0 means greedy: the argmax, ignoring top_k, top_p and generator. Otherwise the
    logits are divided by temperature, cut to the top_k most likely tokens and then to the
    smallest set whose probability reaches top_p (nucleus sampling, Holtzman et al. 2019), and
    one token is drawn with `generator` (torch's default generator when None).
    """
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    probs = sampling_probs(logits, temperature, top_k, top_p)  # (B, vocab)
    return draw(probs, exponential_noise(probs, generator))  # (B, 1)


def sampling_probs(logits, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """The distribution sample_next draws from, (B, vocab): softmax of logits / temperature (> 0) cut to
    top_k, then to top_p. Each row on its own, so rows of many requests with one setting go in one call."""
    logits = logits / temperature if temperature != 1 else logits  # x / 1 is x: a pass over (B, vocab) saved
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        logits = _nucleus(logits, top_p)
    return torch.softmax(logits, dim=-1)  # (B, vocab)


def exponential_noise(probs, generator=None) -> torch.Tensor:
    """Exp(1) noise shaped like probs (B, vocab), drawn from generator: what torch.multinomial(probs, 1,
    generator=generator) draws, in the same order."""
    return torch.empty_like(probs).exponential_(1, generator=generator)


def draw(probs, noise) -> torch.Tensor:
    """One token per row of probs (B, vocab), given noise (B, vocab) ~ Exp(1): argmax(probs / noise) -> (B, 1).

    The exponential race (the Gumbel-max trick with exp applied) is torch.multinomial's own algorithm for
    one sample, so a row's token is multinomial's from the same generator, bit for bit (tests/test_model.py).
    Unlike multinomial it takes the noise as an argument, so rows drawn from different generators (the
    server's requests, core/serving/engine.py) share one call; and it checks the rows once, where multinomial makes
    three checks that each wait for a value."""
    check_finite(probs.sum(dim=-1))
    return (probs / noise).argmax(dim=-1, keepdim=True)  # (B, 1)


def draw_by_sum(probs, generator=None) -> torch.Tensor:
    """One token per row of probs (B, vocab), drawn as draw draws it (the same distribution) from one uniform number
    per row against the running sum, not one Exp(1) per id: over GPT-2's vocabulary about a tenth of the time, but
    not multinomial's token for a seed. The server's requests sent without a seed (core/serving/engine.py)."""
    total = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, vocab): float64, so an unlikely id keeps its share
    end = check_finite(total[:, -1:])  # (B, 1)
    u = torch.rand(end.shape, dtype=torch.float64, device=end.device, generator=generator) * end
    return torch.searchsorted(total, u.minimum(end.nextafter(torch.zeros_like(end))), right=True)  # (B, 1): u < end


def check_finite(sums: torch.Tensor) -> torch.Tensor:
    if not bool((sums > 0).all()):  # NaN or inf logits; softmax leaves no other way to fail
        raise ValueError("the next token's probabilities are not finite: the logits hold a NaN or inf")
    return sums


def _nucleus(logits, top_p):
    """Mask all but the most likely tokens whose probabilities, taken in order, first reach top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, vocab)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    drop = mass_before >= top_p
    drop[:, 0] = False  # the most likely token always stays, even when top_p rounds to 0 in float32
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits)  # back to vocabulary order


def check_sampling_args(temperature, top_k, top_p) -> None:
    """The one check of how tokens are drawn (generate, sample.py, serve.py): a ValueError whose
    message starts with the setting's name."""
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1 (or unset: no limit), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or unset: no limit), got {top_p}")


@dataclass(frozen=True)
class Sampling:
    """How generate draws each token.

    temperature, top_k, top_p, generator: sample_next's (temperature 0 is greedy). use_cache: decode with a
    KV cache, or recompute every step; both give the same tokens. eot_token: a row stops after emitting it.
    vocab_size: draw only ids below it (a padded vocabulary, 50304 for GPT-2's 50257, has ids no tokenizer
    decodes).

    Past block_size the context window slides window_shift tokens at once. Learned positions make every
    cached key stale when it moves, so the cache is refilled each time. 1 is nanoGPT's rule: the model sees
    exactly the last block_size tokens, and with a cache each step past block_size is a full forward;
    block_size // 2 (window_shift() below) refills once per block_size // 2 tokens and stays fast.

    rolling_cache (pos_embedding="rope", window_shift=1) keeps every cached key past block_size and
    overwrites the oldest, at cached speed. A deeper layer's key was computed from the context its token
    saw, so with n_layer > 1 this is sliding-window attention (as Mistral's), not nanoGPT's rule.
    """
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    use_cache: bool = True
    eot_token: int | None = None
    window_shift: int = 1
    vocab_size: int | None = None
    rolling_cache: bool = False


def slide_window(start: int, length: int, block_size: int, shift: int) -> int:
    """Where the context window of a sequence of `length` tokens starts once the window tokens[start:] has
    outgrown block_size: `shift` further on, or further still if that is not enough (a prompt longer than
    block_size). generate and the server's engine both slide by this one rule."""
    return max(start + shift, length - block_size)


def window_shift(requested: int | None, block_size: int) -> int:
    """How far the context window slides at once past block_size (see generate): `requested`, or
    by default half the window, so that a KV cache is refilled only once per block_size // 2 tokens.
    The one check of window_shift: a ValueError for less than 1 or more than block_size."""
    shift = max(1, block_size // 2) if requested is None else requested
    if shift < 1:
        raise ValueError(f"window_shift must be at least 1 (or None for block_size // 2), got {shift}")
    if shift > block_size:
        raise ValueError(f"window_shift {shift} is larger than the model's block_size {block_size}")
    return shift


@torch.no_grad()
def generate(model: GPT, idx, max_new_tokens, sampling: Sampling | None = None, steps: "FixedSteps | None" = None,
             **settings) -> torch.Tensor:
    """Continue idx (B, T) by up to max_new_tokens -> (B, T + new). Call model.eval() first (inference_model does).

    How tokens are drawn is one Sampling value, or its fields by name (temperature=0.8, top_k=200, ...).
    With eot_token, rows that emitted it are padded with it, and generation ends once all have. steps: the
    fixed-shape step inference_model chose (None: the model's own forward with a KVCache).
    """
    return torch.cat([idx, *generate_stream(model, idx, max_new_tokens, sampling, steps, **settings)], dim=1)

def generate_stream(model: GPT, idx, max_new_tokens, sampling: Sampling | None = None,
                    steps: "FixedSteps | None" = None, **settings) -> Iterator[torch.Tensor]:
    """Like generate, but yields each new token as a (B, 1) tensor as soon as it is sampled."""
    s = sampling or Sampling(**settings)
    check_sampling_args(s.temperature, s.top_k, s.top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    window_shift(s.window_shift, model.config.block_size)
    if s.vocab_size is not None and not 1 <= s.vocab_size <= model.config.vocab_size:
        raise ValueError(f"vocab_size must be in [1, {model.config.vocab_size}], got {s.vocab_size}")
    if s.rolling_cache and (model.config.pos_embedding != "rope" or s.window_shift != 1):
        raise ValueError("rolling_cache needs pos_embedding='rope' and window_shift=1: learned positions make "
                         "every cached key stale when the window moves")
    return _stream(model, idx, max_new_tokens, s, steps)

@torch.no_grad()
def _stream(model: GPT, idx, max_new_tokens, s: Sampling, steps):
    block_size = model.config.block_size
    cache, step = None, None
    if s.use_cache and steps is not None:
        cache, step = steps.get(idx.size(0))
    elif s.use_cache:
        cache = model.new_kv_cache(idx.size(0), min(block_size, idx.size(1) + max_new_tokens))
    start = max(0, idx.size(1) - block_size)  # the context window is idx[:, start:]
    origin = start  # idx[:, origin] is the cache's position 0
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # (B,)
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block_size:
            start = slide_window(start, idx.size(1), block_size, s.window_shift)
            if cache is not None and not s.rolling_cache:
                cache.reset()  # every token moved to a new position: the cached keys are stale
                origin = start
        logits = _next_logits(model, idx, start, origin, cache, step)[:, :s.vocab_size]  # (B, vocab)
        token = sample_next(logits, s.temperature, s.top_k, s.top_p, s.generator)  # (B, 1)
        if s.eot_token is not None:
            token = token.masked_fill(done[:, None], s.eot_token)
            done |= token[:, 0] == s.eot_token
        idx = torch.cat([idx, token], dim=1)
        yield token
        if s.eot_token is not None and bool(done.all()):
            return

def _next_logits(model: GPT, idx, start, origin, cache, step=None):
    """Logits (B, vocab) for the token after idx (B, T) seen through the window idx[:, start:];
    with a cache (position 0 at idx[:, origin]) only the tokens not cached yet go through the model,
    one token through the fixed-shape step where there is one."""
    if cache is None:
        return model(idx[:, start:], last_only=True)[0][:, -1, :]
    if step is not None:
        return cache.feed(model, idx[:, origin + cache.pos:], step)[:, -1, :]
    return model(idx[:, origin + cache.pos:], kv_cache=cache, last_only=True)[0][:, -1, :]


# -----------------------------------------------------------------------------
# the fixed-shape step: one token through a StaticCache, compiled, a CUDA graph on CUDA

def fixed_step_chosen(device_type: str) -> bool:
    """Whether decoding takes the compiled fixed-shape step: on CUDA, where launching a step's ~200 kernels from
    Python is the step (docs/performance.md, "On a GPU") and a CUDA graph launches them as one."""
    return device_type == "cuda"


class FixedStep(nn.Module):
    """One token through model and cache (a StaticCache): the same shapes at every position, so compiled once."""

    def __init__(self, model: GPT, cache: StaticCache):
        super().__init__()
        self.model, self.cache = model, cache  # submodules: compile takes the cache's buffers as static

    def forward(self, token):  # (B, 1) -> logits (B, 1, vocab), float32
        return self.model(token, kv_cache=self.cache, last_only=True)[0]


def compile_step(step: FixedStep, device_type: str):
    """step compiled whole (fullgraph: a break would leave Python in the step); on CUDA captured as a CUDA graph
    (mode="reduce-overhead"), each call a new replay whose outputs overwrite the last's, read by then."""
    if device_type != "cuda":
        return torch.compile(step, fullgraph=True, dynamic=False)
    graph = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def replay(token):
        torch.compiler.cudagraph_mark_step_begin()
        return graph(token)
    return replay


class FixedSteps:
    """A model's fixed-shape steps, one StaticCache (block_size slots) and one compiled step per batch size, built
    at the first generate of that size and reused by every later one (a captured graph replays in place)."""

    def __init__(self, model: GPT, device_type: str, compile=compile_step):
        self.model, self.device_type, self.compile, self.built = model, device_type, compile, {}

    def get(self, batch_size: int) -> tuple[StaticCache, object]:
        if batch_size not in self.built:
            cache = StaticCache(self.model, batch_size)
            self.built[batch_size] = cache, self.compile(FixedStep(self.model, cache), self.device_type)
        cache, step = self.built[batch_size]
        cache.reset()
        return cache, step


def inference_model(model: GPT, rt: Runtime, compile: bool = False, quantize: str = "none",
                    batched: bool = False) -> tuple[GPT, FixedSteps | None]:
    """The model as it decodes, and the fixed-shape steps to decode one token with where they are chosen
    (fixed_step_chosen: CUDA; None elsewhere, and under compile, which compiles the whole model instead; the
    prefill stays the model's own forward): on the device, in eval mode, with the CPU's kernel choices
    (kernels.choose_kernels), its weights cast once to the run's dtype and laid out for decoding (lay_out; batched:
    for a server's steps of many rows). Not autocast: it keeps float32 weights and casts each one again at every
    token (with --compile too)."""
    quantization.check_quantize(quantize, device=rt.device)
    model = kernels.choose_kernels(model.eval().to(rt.device, rt.ptdtype))
    fixed = not compile and fixed_step_chosen(rt.device_type)
    lay_out(model, rt, quantize, traced=compile or fixed, batched=batched)
    if compile:
        model.compile()
    return model, FixedSteps(model, rt.device_type) if fixed else None


def lay_out(model: GPT, rt: Runtime, quantize: str, traced: bool, batched: bool = False) -> None:
    """The weights of a model that only decodes, laid out for it. The next token's logits are computed in float32
    whatever the weights (GPT.forward's last_only), by a float32 copy of the head made here once (keep_float32_head);
    a float32 model on a CPU has its head's storage laid out by columns instead (cpu.lay_head_by_columns), the same
    floats read faster one row at a time, and for a server's steps (batched) on an x86 CPU its matrices packed for
    oneDNN too, faster than MKL at 2 to 64 rows (cpu.pack_linears). A bfloat16 model on an x86 CPU that computes it
    natively hands its Blocks' large matrices to oneDNN once (cpu.pack_linears), so that a product at one row reads
    each weight once. Neither where the step is traced (compiled), nor on ARM, where it was never measured.
    quantize ("int8", "int4") swaps the Blocks' matrices and the head for quantized ones (core/decoding/quantize.py),
    never packed, and the head then needs neither a float32 copy nor its columns laid out."""
    if quantize != "none":
        quantization.quantize(model, quantize)
    elif rt.ptdtype != torch.float32:
        keep_float32_head(model)
        if rt.device_type == "cpu" and rt.ptdtype == torch.bfloat16 and not traced and cpu.cpu_packs_bf16():
            cpu.pack_linears(model)
    elif rt.device_type == "cpu":
        cpu.lay_head_by_columns(model)
        if batched and not traced and platform.machine().lower() in ("x86_64", "amd64"):
            cpu.pack_linears(model, batched=True)


def keep_float32_head(model: GPT) -> None:
    """Decoding with bfloat16 (or float16) weights, any device: the head swapped for a Float32Head (inference_model)."""
    model.swap_module("lm_head", Float32Head(model.lm_head))


class Float32Head(nn.Module):
    """The head and a float32 copy of it, made once, that float32 input reads (GPT._last_logits), not casting the
    whole head (vocab x C, GPT-2's largest matrix) again at each token, which costs more than the matmul it feeds.
    Transposed, (C, vocab): at one row h @ weight_t is faster than F.linear over (vocab, C) on a CPU (MKL's GEMV;
    docs/performance.md, "Decoding against the bandwidth bound"). Other input reads the (tied) weight as it was."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight  # (vocab, C)
        self.register_buffer("weight_t", linear.weight.detach().float().t().contiguous(), persistent=False)

    def forward(self, x):  # (..., C) -> (..., vocab)
        return x @ self.weight_t if x.dtype == torch.float32 else nn.functional.linear(x, self.weight)
