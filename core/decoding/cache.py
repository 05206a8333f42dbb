"""Three KV caches beside model.KVCache, answering what GPT.forward asks of it: RowCache, each row at its own
position, the server's batch (core/serving/engine.py); Segments, views of it fed side by side as one row, chunks of
any lengths in one forward; StaticCache, the fixed-shape step's (decode.py's FixedStep).

    cache = RowCache(model.new_kv_cache(16))             # 16 slots, all at position 0
    model(tokens, kv_cache=cache.rows(0, hi))             # slots 0..hi-1, each at its own position (a view)
    model(joined, kv_cache=Segments([(cache.rows(0, hi), 1), (cache.rows(s, s + 1), T)]))  # joined: (1, hi + T)

Row b's chunk goes to [pos[b]:pos[b]+T] of the buffers; every row reads the first keys_seen(T) slots, masked to its
own keys (RowCache.write_masked). Rows all at one position go the plain cache's way, unmasked: generate's floats.
StaticCache: see its docstring.
"""
import functools
import types

import torch
import torch.nn as nn

from model import KVCache


class RowCache(KVCache):
    """The buffers of cache (GPT.new_kv_cache's), row b at its own position pos[b]: a LongTensor (B,) on the CPU."""

    def __init__(self, cache: KVCache):
        self.k, self.v = cache.k, cache.v
        self.pos = torch.zeros(self.k.size(1), dtype=torch.long)  # every slot at 0
        self.at = None  # positions()'s: the chunk's slots (B, T), or None for the plain path

    def rows(self, start: int, stop: int) -> "RowCache":  # the same buffers, a view of the positions
        view = RowCache.__new__(RowCache)
        view.k, view.v, view.pos, view.at = self.k[:, start:stop], self.v[:, start:stop], self.pos[start:stop], None
        return view

    def keys_seen(self, T: int) -> int:  # the furthest row's
        return int(self.pos.max()) + T

    def positions(self, T: int, device) -> torch.Tensor:
        """The chunk's positions: (T,) when every row is at one position, the plain path; else (B, T), per row, and
        the mask every layer's write_masked returns, made once here."""
        if bool((self.pos == self.pos[0]).all()):
            self.at = None
            return torch.arange(int(self.pos[0]), int(self.pos[0]) + T, device=device)  # (T,)
        self.at = self.pos.to(device)[:, None] + torch.arange(T, device=device)  # (B, T) each new key's slot
        self.mask = (torch.arange(self.keys_seen(T), device=device) <= self.at[:, :, None])[:, None]  # (B, 1, T, Tk)
        return self.at

    def layer(self, i: int):
        if self.at is None:  # every row at one position: the plain cache's write, the same floats as generate
            return functools.partial(self.write, self.k[i], self.v[i], int(self.pos[0]))
        return functools.partial(self.write_masked, self.k[i], self.v[i])

    def write_masked(self, k_cache, v_cache, k, v):
        """One layer's buffers (B, nkv, max_len, hs): row b's new k, v (B, nkv, T, hs) go to slots at[b] -> the first
        Tk keys and values (B, nkv, Tk, hs) and the mask (B, 1, T, Tk) of the keys up to each query's own slot."""
        rows = torch.arange(k.size(0), device=k.device)[:, None]  # (B, 1), broadcast against at (B, T)
        k_cache[rows, :, self.at], v_cache[rows, :, self.at] = k.transpose(1, 2), v.transpose(1, 2)
        Tk = self.mask.size(-1)
        return k_cache[:, :, :Tk], v_cache[:, :, :Tk], self.mask

    def advance(self, T: int):
        self.pos += T  # in place, so a rows() view moves its parent's rows

    def reset(self):  # every row back to 0, in place
        self.pos.zero_()


class Segments(KVCache):
    """Views of KV caches fed in one forward as a single row (1, N): part j, (view, T), is the view's B rows of T
    tokens each, row after row, after part j-1's. Every matrix product takes all N tokens at once, so a step that
    decodes some rows and prefills others reads each weight once, as vLLM's and llama.cpp's batches do; only the
    attention goes part by part (attend), each view writing and reading its own keys as when fed alone."""

    batch_size = 1

    def __init__(self, parts: list[tuple[KVCache, int]]):
        self.parts, self.k = parts, parts[0][0].k  # the views' one buffer, whose length KVCache.max_len reads

    def keys_seen(self, T: int) -> int:
        return max(view.keys_seen(t) for view, t in self.parts)

    def positions(self, T: int, device) -> torch.Tensor:  # (1, N): each part's (B, T), row after row
        parts = [view.positions(t, device).expand(view.batch_size, t).flatten() for view, t in self.parts]
        return torch.cat(parts)[None]

    def layer(self, i: int):
        return types.SimpleNamespace(attend=functools.partial(self.attend, [view.layer(i) for view, _ in self.parts]))

    def attend(self, writes, q, k, v, attention):
        """q (1, nh, N, hs), k and v (1, nkv, N, hs): each part's written by its view's layer, and attended by
        attention(q, k, v, mask) over its keys -> (1, nh, N, hs)."""
        ys, o = [], 0
        for (view, T), write in zip(self.parts, writes):
            B = view.batch_size
            part = lambda t: t[0, :, o:o + B * T].unflatten(1, (B, T)).transpose(0, 1)  # (B, heads, T, hs)
            ys.append(attention(part(q), *write(part(k), part(v))).transpose(0, 1).flatten(1, 2))  # (nh, B * T, hs)
            o += B * T
        return (ys[0] if len(ys) == 1 else torch.cat(ys, dim=1))[None]  # the decoding rows alone: no copy

    def advance(self, T: int):
        for view, t in self.parts:
            view.advance(t)

    def last(self, x: torch.Tensor) -> torch.Tensor:  # (1, N, C) -> (rows, 1, C): each view's rows' last
        parts = x[0].split([view.batch_size * t for view, t in self.parts])
        return torch.cat([view.last(p.unflatten(0, (view.batch_size, t))) for (view, t), p in zip(self.parts, parts)])


class StaticCache(nn.Module):
    """A KV cache whose one-token step has the same shapes at every position, so that torch.compile builds it once
    and a CUDA graph replays it (core/decoding/decode.py's fixed step): a buffer per layer (through views of one
    buffer for all layers, inductor copied the whole cache at each step), each row's next slot `at` a tensor on the
    device, and a step that attends over all max_len slots masked to those written. A module, so that compile takes
    its buffers for static addresses, which a captured graph writes in place.

        cache = StaticCache(model, batch_size=4)        # max_len: block_size
        logits = cache.feed(model, prompt)              # a chunk (T > 1): written and read as model.KVCache does
        logits = cache.feed(model, token, step)         # one token: step(token), e.g. a compiled FixedStep

    What GPT.forward asks of it: a chunk is written at pos, the host's count of positions cached; one token at `at`
    by index, reading max_len keys under a mask. advance moves `at` in place, within the step; feed moves pos outside
    anything compiled: a Python int read in a compiled step is a constant there, and a new one would recompile it.
    Rotary positions roll past max_len one token at a time, as model.KVCache(rolling) does."""

    def __init__(self, model, batch_size: int, max_len: int | None = None, dtype=None):
        super().__init__()
        like = model.new_kv_cache(batch_size, 1, dtype)  # the plain cache's dtype and device
        c, device = model.config, like.k.device
        shape = (batch_size, c.kv_heads, max_len or c.block_size, c.head_size)
        self.rolling, self.pos = c.pos_embedding == "rope", 0
        for i in range(c.n_layer):
            for kv in "kv":
                self.register_buffer(f"{kv}{i}", torch.zeros(shape, dtype=like.k.dtype, device=device),
                                     persistent=False)
        self.register_buffer("at", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("slots", torch.arange(shape[2], device=device), persistent=False)  # (max_len,)
        self.register_buffer("rows", torch.arange(batch_size, device=device), persistent=False)  # (B,)

    @property
    def batch_size(self) -> int:
        return self.at.numel()

    @property
    def max_len(self) -> int:
        return self.slots.numel()

    def feed(self, model, idx: torch.Tensor, step=None) -> torch.Tensor:
        """idx (B, T), the tokens after the pos cached -> the last one's logits (B, 1, vocab), float32. One token goes
        through step (a FixedStep) where given."""
        T = idx.size(1)
        if self.pos + T > self.max_len and not (self.rolling and T == 1):
            raise ValueError(f"KV cache holds {self.max_len} positions; {self.pos} used, {T} more do not fit")
        if step is not None and T == 1:  # a fresh (B, 1): a slice of the growing idx has a new stride each position,
            logits = step(idx.clone(memory_format=torch.contiguous_format))  # which a compiled step guards on
        else:
            logits = model(idx, kv_cache=self, last_only=True)[0]
        self.pos += T
        return logits

    def keys_seen(self, T: int) -> int:  # one token reads every slot, masked
        return self.max_len if T == 1 else self.pos + T

    def positions(self, T: int, device) -> torch.Tensor:  # one token: (B, 1), each row's; a chunk: (T,)
        return self.at[:, None] if T == 1 else torch.arange(self.pos, self.pos + T, device=device)

    def layer(self, i: int):
        return functools.partial(self.write, getattr(self, f"k{i}"), getattr(self, f"v{i}"))

    def write(self, k_cache, v_cache, k, v):
        """k, v (B, nkv, T, hs). A chunk: model.KVCache.write at pos. One token: row b's to slot at[b] (modulo
        max_len once a rotary cache rolls) -> all max_len slots, and the mask (B, 1, 1, max_len) of those written."""
        if k.size(2) > 1:
            return KVCache.write(k_cache, v_cache, self.pos, k, v)
        slot = self.at % self.max_len  # (B,)
        k_cache[self.rows, :, slot], v_cache[self.rows, :, slot] = k[:, :, 0], v[:, :, 0]
        mask = self.slots <= self.at[:, None]  # (B, max_len): every slot once the cache rolls
        return k_cache, v_cache, mask[:, None, None]  # (B, nkv, max_len, hs) x 2, (B, 1, 1, max_len)

    def advance(self, T: int):
        self.at += T

    def last(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, 1, C)
        return x[:, -1:]

    def reset(self):
        self.pos = 0
        self.at.zero_()
