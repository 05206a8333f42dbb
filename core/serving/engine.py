"""BatchEngine: continuous batching for the server (docs/serving.md, "Requests at once"). One thread; each step runs
one model forward over the next token of every decoding row of every request, each row at its own position in
one KV cache (core/decoding/cache.py's RowCache, max_batch slots: a request's n rows take n of them), and the
next chunks of the prompts being prefilled, within one token budget (step_tokens). The KV of every prompt's and
reply's leading blocks outlives its request in a PrefixCache, and a later prompt that starts with the same tokens
is prefilled from there on.

    engine = BatchEngine(model, EngineSettings(max_batch=16, window_shift=128, vocab_size=tok.vocab_size))
    engine.start()
    handle = engine.submit(EngineRequest(prompt=ids, n=1, max_tokens=50, sampling=Sampling(temperature=0)), loop)
    async for event in handle.events(): ...     # PromptScores once, then one list[RowStep] per step

The decoding math is decode.py's, not a second copy (sampling_probs and draw, each request's rows from its own
generator; slide_window; uncached tokens fed as _next_logits feeds them), so a request's text is what
decode.generate gives it alone (tests/test_engine.py), up to the rounding of batched matmuls; a request with no seed
(no generator) draws from the engine's by draw_by_sum, the same distribution. The server's logit rules
(adjust_logits) are the engine's alone.
EngineProcess (core/serving/process.py) runs a BatchEngine in a process of its own behind the same caller's side.
"""
import asyncio
import collections
import dataclasses
import hashlib
import itertools
import math
import queue
import secrets
import threading
import time
from typing import AsyncIterator

import torch
from torch.nn import functional as F

from core.decoding.cache import RowCache, Segments
from core.decoding.decode import (Sampling, check_sampling_args, draw, draw_by_sum, exponential_noise, sampling_probs,
                                  slide_window)
from core.errors import first_line
from model import GPT

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
BLOCK = 16  # tokens per prefix-cache block, vLLM's default: a prompt reuses a cached prefix to a multiple of it


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """How an engine is built: BatchEngine takes it, and EngineProcess hands it as it is to its process."""
    max_batch: int  # the most rows decoded at once: the KV cache's slots, allocated once
    window_shift: int  # past block_size a row's window slides this far at once (decode.window_shift)
    vocab_size: int  # the tokenizer's: logprobs list no id past it
    step_tokens: int = 512  # the tokens one step computes: a decoding row's one, prompt chunks the rest
    prefix_cache_tokens: int | None = None  # the prefix cache's size; None: as many as the KV cache's slots hold


@dataclasses.dataclass
class EngineRequest:
    """One prompt's generation: n rows drawn with `sampling` (its generator seeded by the caller)."""
    prompt: list[int]
    n: int
    max_tokens: int  # 0: score the prompt only (with prompt_logprobs)
    sampling: Sampling
    logprobs: int | None = None  # None: none; k in 0..20: each token's logprob and the k most likely
    prompt_logprobs: int | None = None  # likewise for the prompt's own tokens (PromptScores)
    presence_penalty: float = 0.0  # OpenAI's, on generated tokens (adjust_logits)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    repetition_penalty: float = 1.0  # vLLM's, on tokens of the prompt or generated
    min_tokens: int = 0  # stop_tokens are banned until this many tokens are generated
    stop_tokens: tuple[int, ...] = ()  # the ids that end a choice (its end of text, or of a chat turn)
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p times the likeliest (at the temperature) are dropped
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: no other id is drawn
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's: a word's last id is banned where its others were just drawn


@dataclasses.dataclass
class TokenScore:
    """A token's log-probability, its rank (1: the likeliest) and the `top` most likely tokens at its position,
    [(id, logprob)]."""
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 1

    def cut(self, k: int) -> "TokenScore":  # the k most likely only
        return self if len(self.top) <= k else TokenScore(self.logprob, self.top[:k], self.rank)


@dataclasses.dataclass
class RowStep:
    token: int
    score: TokenScore | None  # with logprobs


@dataclasses.dataclass
class PromptScores:
    """A request's prompt is prefilled: `cached` of its tokens came from the prefix cache; with prompt_logprobs its
    tokens scored by the model (scores[0] is None: nothing predicts the first token)."""
    scores: list[TokenScore | None] | None
    cached: int = 0


class ServerStopping(Exception):
    pass


class EngineDied(Exception):
    """The engine's process ended on its own (killed, out of memory): nothing can be generated any more."""


class NothingToDraw(ValueError):
    """A request's own rules ban every token (allowed_token_ids, bad_words, min_tokens' ban): it ends alone, the
    client's error, and the requests beside it go on."""


def adjust_logits(logits: torch.Tensor, req: EngineRequest, generated: int, counts: torch.Tensor | None,
                  prompt_seen: torch.Tensor | None, bias: torch.Tensor | None, outputs: list[list[int]] = ()):
    """The request's rules on logits (n, V), in vLLM's sampler's order (docs/serving.md): logit_bias and
    allowed_token_ids (bias (V,)); bad_words, after each row's outputs (its ids so far, given with bad_words); the
    stop tokens banned below min_tokens; repetition_penalty on tokens of the prompt (prompt_seen (V,)) or
    generated (counts (n, V)); OpenAI's frequency and presence penalties; then min_p, at the temperature."""
    if bias is not None:
        logits = logits + bias
    if req.bad_words:
        logits = logits.clone()
        for row, out in enumerate(outputs):
            logits[row, [w[-1] for w in req.bad_words if len(w) - 1 <= len(out)
                         and out[len(out) - len(w) + 1:] == list(w[:-1])]] = float("-inf")
    if generated < req.min_tokens and req.stop_tokens:
        logits = logits.index_fill(1, torch.tensor(req.stop_tokens, device=logits.device), float("-inf"))
    if counts is not None:
        if req.repetition_penalty != 1:
            seen = counts > 0 if prompt_seen is None else (counts > 0) | prompt_seen
            penalised = torch.where(logits > 0, logits / req.repetition_penalty, logits * req.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        logits = logits - req.frequency_penalty * counts - req.presence_penalty * (counts > 0).to(logits.dtype)
    if req.min_p > 0 and req.sampling.temperature > 0:  # p < min_p * p_max at temperature T, in logits
        floor = logits.max(dim=-1, keepdim=True).values + req.sampling.temperature * math.log(req.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def score(logprobs: torch.Tensor, tokens: torch.Tensor, k: int, vocab_size: int) -> list[TokenScore]:
    """TokenScores of tokens (n,) under logprobs (n, V): the token's float, its rank and the k most likely ids below
    vocab_size, taken from the same tensor, so the argmax's float is identical in both."""
    picked = logprobs.gather(1, tokens[:, None])  # (n, 1)
    ranks = ((logprobs[:, :vocab_size] > picked).sum(dim=-1) + 1).tolist()  # (n,)
    top = logprobs[:, :vocab_size].topk(min(k, vocab_size), dim=-1)  # k = 0: none, (n, 0)
    return [TokenScore(lp, list(zip(ids, vals)), rank) for lp, ids, vals, rank in
            zip(picked[:, 0].tolist(), top.indices.tolist(), top.values.tolist(), ranks)]


def block_hashes(tokens: list[int]) -> list[bytes]:
    """One key per full BLOCK of tokens: a hash of the block and of every token before it (vLLM's chained block
    hash), so that equal keys mean equal prefixes. SHA-256: a client cannot make two prefixes collide."""
    keys, key = [], b""
    for i in range(BLOCK, len(tokens) + 1, BLOCK):
        key = hashlib.sha256(key + b"".join(t.to_bytes(4, "little") for t in tokens[i - BLOCK:i])).digest()
        keys.append(key)
    return keys


@dataclasses.dataclass
class Block:
    """A prefix-cache block: BLOCK positions of keys and values (L, nkv, BLOCK, hs); with the prompt scores of its
    tokens where a request with prompt_logprobs computed it, each with the `top` most likely."""
    k: torch.Tensor
    v: torch.Tensor
    scores: list[TokenScore | None] | None = None
    top: int = -1


class PrefixCache:
    """The KV of token blocks kept after their requests end (docs/serving.md, "The prefix cache"), found by
    block_hashes; once it holds `capacity` blocks, the least recently used goes first, and of a prefix's blocks
    used together the last first (as vLLM frees them): a block is of no use once the one before it has gone."""

    def __init__(self, capacity: int):
        self.capacity, self.blocks = capacity, collections.OrderedDict()

    def match(self, keys: list[bytes], top: int | None) -> list[Block]:
        """The cached blocks of keys' leading run (each with scores of at least `top`, given it)."""
        found = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None or (top is not None and block.top < top):
                break
            found.append(block)
        self._used(keys[:len(found)])
        return found

    def keep(self, keys: list[bytes], k: torch.Tensor, v: torch.Tensor, scores=None, top: int = -1) -> None:
        """Blocks keys of a row's keys and values k, v (L, nkv, T, hs) (and of its prompt scores) kept; a block
        already held is only marked used, unless these scores are wider."""
        for j, key in enumerate(keys if self.capacity else []):
            if key not in self.blocks or self.blocks[key].top < top:
                part = slice(j * BLOCK, (j + 1) * BLOCK)
                self.blocks[key] = Block(k[:, :, part].clone(), v[:, :, part].clone(),
                                         None if scores is None else scores[part], top)
        self._used([key for key in keys if key in self.blocks])
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def _used(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the first block most recently used: evicted last
            self.blocks.move_to_end(key)


def check_submission(req: EngineRequest, settings: EngineSettings, stopping) -> None:
    """What both engines refuse at submit: more rows than the cache has slots (a row takes one), or any request
    once stopping."""
    if not 1 <= req.n <= settings.max_batch:
        raise ValueError(f"n must be in 1..{settings.max_batch} (the engine's max_batch), got {req.n}")
    if stopping.is_set():
        raise ServerStopping()


class Handle:
    """A submitted request: its events cross from the engine thread to the caller's event loop."""

    def __init__(self, req: EngineRequest, loop: asyncio.AbstractEventLoop):
        self.req, self.loop = req, loop
        self.out: asyncio.Queue = asyncio.Queue()  # PromptScores, list[RowStep] per step; then None or an exception
        self.cancelled = threading.Event()
        self.submitted = time.monotonic()

    def queued(self) -> int:
        """Events that have arrived and not been taken yet (more than 0: the caller lags the engine)."""
        return self.out.qsize()

    async def events(self) -> AsyncIterator:
        """Each event until the generation ends; leaving early (the caller's break or close) cancels it."""
        try:
            while (item := await self.out.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the generation (the engine drops it at its next step); nothing once it has ended."""
        self.cancelled.set()


def deliver(events: list[tuple[Handle, object]]) -> None:
    """On a caller's event loop: one engine step's events, each to its handle's queue."""
    for handle, item in events:
        handle.out.put_nowait(item)


class Active:
    """A request in the batch: its slots, every row's tokens so far, its context window."""

    def __init__(self, handle: Handle, slots: list[int], vocab: int, block_size: int, device):
        req = handle.req
        self.handle, self.req, self.slots = handle, req, slots
        self.tokens = [list(req.prompt) for _ in slots]  # each row's whole sequence
        # The context window is tokens[start:], the cache's position 0 at tokens[start] (generate's rule).
        self.start = max(0, len(req.prompt) - block_size)
        self.generated = 0
        self.done = [False] * len(slots)  # rows that emitted eot (then padded with it)
        self.keys = block_hashes(self.tokens[0][self.start:])  # the prompt window's blocks, for the prefix cache
        self.cached: int | None = None  # the prompt's tokens taken from the prefix cache, once looked up
        self.prompt_scores: list[TokenScore | None] = [None]
        self.prompt_last: torch.Tensor | None = None  # log-softmax of the last prefilled position (prompt_logprobs)
        self.last: list[torch.Tensor | None] = [None] * len(slots)  # each row's next-token logits, once prefilled
        vocab = req.sampling.vocab_size or vocab  # the ids drawn from, and so counted and biased
        penalised = req.presence_penalty or req.frequency_penalty or req.repetition_penalty != 1
        self.counts = torch.zeros(len(slots), vocab, device=device) if penalised else None  # each row's tokens
        self.prompt_seen = None
        if req.repetition_penalty != 1:
            self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.prompt_seen[[t for t in req.prompt if t < vocab]] = True
        self.bias = None  # logit_bias's values, and -inf on every id outside allowed_token_ids
        if req.logit_bias or req.allowed_token_ids is not None:
            self.bias = torch.full((vocab,), 0.0 if req.allowed_token_ids is None else float("-inf"), device=device)
            self.bias[list(req.allowed_token_ids or ())] = 0.0
            self.bias[list(req.logit_bias)] += torch.tensor(list(req.logit_bias.values()), device=device)


class BatchEngine:
    """See the module docstring. metrics, if given, is told of each step (core/serving/metrics.py's Metrics)."""

    def __init__(self, model: GPT, settings: EngineSettings, metrics=None):
        self.model, self.settings, self.metrics = model, settings, metrics
        self.block_size = model.config.block_size
        self.device = model.transformer.wte.weight.device
        self.cache = RowCache(model.new_kv_cache(settings.max_batch))  # each slot at its own position
        tokens = settings.prefix_cache_tokens
        self.prefix = PrefixCache((settings.max_batch * self.block_size if tokens is None else tokens) // BLOCK)
        self.free = list(range(settings.max_batch))
        self.active: list[Active] = []
        self.pending: queue.Queue[Handle] = queue.Queue()
        self.waiting: list[Handle] = []  # taken from pending, not yet admitted (no room)
        self.outbox: list[tuple[Handle, object]] = []  # this step's events, sent together by _flush
        self.stopping = threading.Event()
        self.failure: str | None = None  # never set: a failing step fails its requests, the thread goes on
        self.running = 0  # requests in the batch (for /health and /metrics)
        self.tokens_generated = 0  # steps taken, one per request per step (for /health)
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.rng = torch.Generator(self.device).manual_seed(secrets.randbits(63))  # requests sent with no seed

    # --- the caller's side -------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def submit(self, req: EngineRequest, loop: asyncio.AbstractEventLoop) -> Handle:
        check_submission(req, self.settings, self.stopping)
        handle = Handle(req, loop)
        self.pending.put(handle)
        return handle

    def waiting_count(self) -> int:
        return len(self.waiting) + self.pending.qsize()

    @property
    def slots_used(self) -> int:  # the KV cache's slots held by requests (for /metrics)
        return self.settings.max_batch - len(self.free)

    # --- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._admit(block=not self.active)
                for active in [a for a in self.active if a.handle.cancelled.is_set()]:
                    self._finish(active, None)
                if self.active:
                    self.step()
            except Exception as e:  # out of memory, a broken model: these requests fail, the server goes on
                for active in list(self.active):
                    self._finish(active, RuntimeError(f"generation failed: {first_line(e)}"))
            self._flush()
        for active in list(self.active):
            self._finish(active, ServerStopping())
        for h in self.waiting + list(self.pending.queue):
            self._send(h, ServerStopping())
        self._flush()

    def _send(self, handle: Handle, item) -> None:
        self.outbox.append((handle, item))

    def _flush(self) -> None:
        """A step's events cross to each event loop in one call: one wake-up of the loop per step, not one
        per request (each is a write to the loop's self-pipe and a callback, under the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, item in self.outbox:
            by_loop.setdefault(handle.loop, []).append((handle, item))
        self.outbox = []
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, events)
            except RuntimeError:  # the event loop has closed (shutting down): nobody is waiting for these any more
                pass

    def _admit(self, block: bool) -> None:
        """Move requests that fit into free slots, first come first served; wait a little when idle."""
        try:
            while True:
                self.waiting.append(self.pending.get(timeout=0.1) if block and not self.waiting
                                    else self.pending.get_nowait())
                block = False
        except queue.Empty:
            pass
        while self.waiting and self.waiting[0].req.n <= len(self.free):
            handle = self.waiting.pop(0)
            if handle.cancelled.is_set():
                self._send(handle, None)
                continue
            slots = sorted(self.free)[:handle.req.n]  # the lowest free slots keep the decode batch short
            self.free = [s for s in self.free if s not in slots]
            self.cache.pos[slots] = 0
            try:
                self.active.append(Active(handle, slots, self.model.config.vocab_size, self.block_size, self.device))
            except Exception as e:  # a logit_bias id past the model's vocabulary, say: this request fails alone
                self.free += slots
                self._send(handle, RuntimeError(f"generation failed: {first_line(e)}"))
        self.running = len(self.active)

    def _finish(self, active: Active, end) -> None:
        if end is None:  # done or cancelled: each row's blocks (its prompt's, its reply's) for a later prompt
            for r in range(len(active.slots)):
                self._keep(active, r)
        self._send(active.handle, end)
        self.active.remove(active)
        self.cache.pos[active.slots] = 0  # a free slot rides along as a dummy at position 0
        self.free += active.slots
        self.running = len(self.active)

    @torch.no_grad()  # as generate: no graph (the cache's in-place writes would chain every step's into it)
    def step(self) -> None:
        """One forward over every decoding row's next token and the other requests' prompt chunks within what is left
        of step_tokens, side by side (_forward), a prompt scored at every position after it, alone (_prefill_echo:
        once all in, its slot may sit at block_size, where it could not ride along as a dummy); then every request
        whose rows have next-token logits draws."""
        decoding = [active for active in self.active if active.generated and self._uncached(active) == 1]
        budget = max(1, self.settings.step_tokens - sum(len(active.slots) for active in decoding))
        feeds, echoes = self._prefill([active for active in self.active if active not in decoding], budget)
        ready = self._forward(decoding, feeds) if decoding or feeds else []
        ready += [(active, got) for active, share in echoes if (got := self._prefill_echo(active, share)) is not None]
        self._draw(ready)

    def _uncached(self, active: Active) -> int:
        """Tokens of the request's window not yet in its rows' cache: 1 while decoding (the token just drawn)."""
        return len(active.tokens[0]) - active.start - int(self.cache.pos[active.slots[0]])

    def _prefill(self, waiting: list[Active], budget: int) -> tuple[list, list]:
        """Up to budget uncached tokens, first come first served, for the rows that need them: a new prompt's first
        row, from where the prefix cache leaves it (its keys then copied to its other rows), or every row of a
        request whose window moved (each refills its own window, as generate does); a prompt scored at every position
        (prompt_logprobs) goes alone. A prompt whose next block an earlier one is computing waits for it.
        -> feeds (request, row, tokens), echoes (request, its share of the budget)."""
        feeds, echoes, computing = [], [], set()  # computing: the keys of blocks this step's prompts compute
        for active in waiting:
            if budget <= 0:
                break
            if active.cached is None and not self._reuse(active, computing):
                continue
            if active.generated == 0:
                computing.update(active.keys[int(self.cache.pos[active.slots[0]]) // BLOCK:])
            if active.generated == 0 and active.req.prompt_logprobs is not None:
                echoes.append((active, budget))
                budget -= self._uncached(active)
                continue
            for r in range(1 if active.generated == 0 else len(active.slots)):
                chunk = active.tokens[r][active.start + int(self.cache.pos[active.slots[r]]):][:budget]
                if chunk and budget > 0:
                    feeds.append((active, r, chunk))
                    budget -= len(chunk)
        return feeds, echoes

    def _forward(self, decoding: list[Active], feeds: list[tuple[Active, int, list[int]]]):
        """One forward (cache.Segments) over slots 0..hi-1, each decoding row's last token at its own position, and
        each feed's chunk through its row alone. Free and prefilling slots below hi ride along as dummies (token 0,
        their position put back, their output unused: their key is overwritten by their next chunk before it is read).
        -> (request, logits (n, V)) for each decoding request, and each fed one whose rows are now all cached."""
        hi = max([s + 1 for active in decoding for s in active.slots], default=0)
        tokens, live = [0] * hi, [False] * hi  # lists, then one tensor each: a tensor's item set costs microseconds
        for active in decoding:
            for r, slot in enumerate(active.slots):
                tokens[slot], live[slot] = active.tokens[r][-1], True
        if self.metrics is not None and decoding:
            self.metrics.batch(sum(live))
        parts = [(self.cache.rows(0, hi), 1)] if hi else []
        parts += [(self.cache.rows(active.slots[r], active.slots[r] + 1), len(chunk)) for active, r, chunk in feeds]
        tokens += [t for _, _, chunk in feeds for t in chunk]
        logits, _ = self.model(torch.tensor([tokens], device=self.device), kv_cache=Segments(parts),
                               last_only=True)  # (hi + len(feeds), 1, V)
        self.cache.pos[:hi] -= (~torch.tensor(live, dtype=torch.bool)).long()
        ready = [(active, rows_of(logits[:hi, 0], active.slots)) for active in decoding]
        for (active, r, _), row in zip(feeds, logits[hi:, 0]):
            if int(self.cache.pos[active.slots[r]]) == len(active.tokens[r]) - active.start:
                active.last[r] = row
        for active in dict.fromkeys(active for active, _, _ in feeds):  # each request once, in order
            if active.generated == 0 and active.last[0] is not None:
                ready.append((active, self._prompt_cached(active, active.last[0][None])))
            elif active.generated and all(x is not None for x in active.last):
                ready.append((active, torch.stack(active.last)))
            else:
                continue
            active.last = [None] * len(active.slots)
        return ready

    def _reuse(self, active: Active, computing: set[bytes]) -> bool:
        """A new prompt's leading blocks that the prefix cache holds, copied into its first row (with their prompt
        scores, where it wants them): all but its last token, which gives the first draw's logits (with
        prompt_logprobs, the last cached token's too, whose logits score the next). False, nothing copied, where
        its next block is among those computing: it waits a step for them."""
        top, slot = active.req.prompt_logprobs, active.slots[0]
        blocks = self.prefix.match(active.keys, top)
        if len(blocks) < len(active.keys) and active.keys[len(blocks)] in computing:
            return False
        active.cached = max(0, min(len(blocks) * BLOCK - (top is not None), len(active.tokens[0]) - active.start - 1))
        if c := active.cached:
            for j, block in enumerate(blocks[:math.ceil(c / BLOCK)]):
                part = slice(j * BLOCK, min(c, (j + 1) * BLOCK))
                self.cache.k[:, slot, :, part] = block.k[:, :, :part.stop - part.start]
                self.cache.v[:, slot, :, part] = block.v[:, :, :part.stop - part.start]
            self.cache.pos[slot] = c
            if top is not None:
                active.prompt_scores += [s.cut(top) for s in [s for b in blocks for s in b.scores][1:c + 1]]
        return True

    def _keep(self, active: Active, r: int, scored: bool = False) -> None:
        """Row r's cached window's full blocks into the prefix cache (scored: the prompt's, just prefilled, with
        its prompt scores)."""
        slot, top = active.slots[r], active.req.prompt_logprobs
        window = active.tokens[r][active.start:active.start + int(self.cache.pos[slot])]
        scored = scored and top is not None
        self.prefix.keep(block_hashes(window), self.cache.k[:, slot], self.cache.v[:, slot],
                         active.prompt_scores if scored else None, top if scored else -1)

    def _prefill_echo(self, active: Active, budget: int):
        """The next chunk of a prompt with prompt_logprobs through its first row, each position's logits scoring
        the token after it -> logits (n, V) once the prompt is all cached, else None."""
        slot, seq = active.slots[0], active.tokens[0][active.start:]
        view = self.cache.rows(slot, slot + 1)
        first = int(view.pos[0])
        chunk = seq[first:first + budget]
        logits, _ = self.model(torch.tensor([chunk], device=self.device), kv_cache=view)  # (1, T, V)
        lp = F.log_softmax(logits[0].float(), dim=-1)  # (T, V)
        if active.prompt_last is not None:  # the last chunk's last position scores this chunk's first token
            lp = torch.cat([active.prompt_last, lp])
        targets = torch.tensor(seq[first + 1 - (active.prompt_last is not None):first + len(chunk)], dtype=torch.long,
                               device=lp.device)
        if len(targets):
            active.prompt_scores += score(lp[:len(targets)], targets, active.req.prompt_logprobs,
                                          self.settings.vocab_size)
        active.prompt_last = lp[-1:]
        return None if first + len(chunk) < len(seq) else self._prompt_cached(active, logits[:, -1])

    def _prompt_cached(self, active: Active, logits: torch.Tensor) -> torch.Tensor:
        """The request's prompt is in its first row's cache: the prefix cache keeps its blocks, the caller hears
        (PromptScores), and the other choices start from the same keys. logits (1, V) of its last token -> (n, V)."""
        self._keep(active, 0, scored=True)
        scored = active.req.prompt_logprobs is not None
        self._send(active.handle, PromptScores(active.prompt_scores if scored else None, active.cached))
        (slot, *others), T = active.slots, int(self.cache.pos[active.slots[0]])
        self.cache.k[:, others, :, :T] = self.cache.k[:, slot:slot + 1, :, :T]  # (L, n-1, nkv, T, hs)
        self.cache.v[:, others, :, :T] = self.cache.v[:, slot:slot + 1, :, :T]
        self.cache.pos[others] = T
        return logits.float().expand(len(active.slots), -1)

    def _draw(self, ready: list[tuple[Active, torch.Tensor]]) -> None:
        """Draw the next token of every row in ready ((request, its logits (n, V))) as generate does, all
        requests with one setting in one call (each request's rows from its own generator); send them."""
        groups: dict[tuple, list[tuple[Active, torch.Tensor, torch.Tensor]]] = {}
        for active, logits in ready:
            req, s = active.req, active.req.sampling
            if req.max_tokens == 0:  # only the prompt's scores were wanted
                self._finish(active, None)
                continue
            outputs = [row[len(req.prompt):] for row in active.tokens] if req.bad_words else ()  # each row's new ids
            cut = adjust_logits(logits[:, :s.vocab_size], req, active.generated, active.counts, active.prompt_seen,
                                active.bias, outputs)  # (n, V)
            if not bool((cut.amax(dim=-1) > float("-inf")).all()):  # all -inf, or NaN: else the group fails
                self._finish(active, NothingToDraw("allowed_token_ids, bad_words and min_tokens leave no token to draw"))
                continue
            groups.setdefault((s.temperature, s.top_k, s.top_p, cut.size(1)), []).append((active, cut, logits))
        for (temperature, top_k, top_p, _), members in groups.items():
            check_sampling_args(temperature, top_k, top_p)
            cuts = torch.cat([cut for _, cut, _ in members])  # (rows, V)
            sizes = [len(active.slots) for active, _, _ in members]  # each request's rows
            if temperature == 0:
                tokens = cuts.argmax(dim=-1, keepdim=True)  # (rows, 1)
            else:  # a request with a seed draws sample.py's tokens (its generator's race); one without, faster
                probs = sampling_probs(cuts, temperature, top_k, top_p).split(sizes)  # each request's (n, V)
                tokens = torch.cat([draw_by_sum(p, self.rng) if (g := active.req.sampling.generator) is None
                                    else draw(p, exponential_noise(p, g)) for (active, _, _), p in zip(members, probs)])
            ids = iter(tokens[:, 0].tolist())
            for (active, _, logits), size in zip(members, sizes):
                self._took(active, list(itertools.islice(ids, size)), logits)

    def _took(self, active: Active, ids: list[int], logits: torch.Tensor) -> None:
        """The request's rows drew ids (n,) from logits (n, V): pad the rows that ended, score, send; finish the
        request if it is done."""
        req, s = active.req, active.req.sampling
        live = active.done.count(False)  # rows still generating: the tokens served (an ended row's pad is not)
        if s.eot_token is not None:
            ids = [s.eot_token if done else t for t, done in zip(ids, active.done)]
            active.done = [done or t == s.eot_token for t, done in zip(ids, active.done)]
        if req.logprobs is not None or active.counts is not None:
            token = torch.tensor(ids, device=logits.device)[:, None]  # (n, 1)
        scores = [None] * len(ids) if req.logprobs is None else score(
            F.log_softmax(logits.float(), dim=-1), token[:, 0], req.logprobs, self.settings.vocab_size)
        if active.counts is not None:
            active.counts.scatter_add_(1, token, torch.ones_like(token, dtype=active.counts.dtype))
        for r, t in enumerate(ids):
            active.tokens[r].append(t)
        active.generated += 1
        self.tokens_generated += 1
        if self.metrics is not None:
            self.metrics.token(active.handle, live)
        self._send(active.handle, [RowStep(t, sc) for t, sc in zip(ids, scores)])
        if active.generated == req.max_tokens or all(active.done):
            self._finish(active, None)
            return
        if len(active.tokens[0]) - active.start > self.block_size:  # generate's window rule, and its cache refill
            active.start = slide_window(active.start, len(active.tokens[0]), self.block_size, s.window_shift)
            self.cache.pos[active.slots] = 0


def rows_of(x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """x's rows at slots: a view where they are consecutive (as a request's usually are), else a gather."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return x[slots[0]:slots[0] + len(slots)]
    return x[slots]


def engine_sampling(temperature: float, top_k: int | None, top_p: float | None, seed: int | None, device,
                    eot: int | None, window_shift: int, vocab_size: int) -> Sampling:
    """decode.Sampling for one request, its generator seeded: what generate would be given for it alone. No seed,
    no generator: the engine draws its rows from its own (draw_by_sum, faster than multinomial's race)."""
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, eot_token=eot,
                    window_shift=window_shift, vocab_size=vocab_size)
