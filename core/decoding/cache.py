"""RowCache: a KV cache with each row at its own position, the server's batch (core/serving/engine.py).

    cache = RowCache(model.new_kv_cache(16))             # 16 slots, all at position 0
    model(tokens, kv_cache=cache.rows(0, hi))             # slots 0..hi-1, each at its own position (a view)
    model(chunks, kv_cache=cache.take(slots, lengths))    # ragged chunks of any slots in one forward

It answers what GPT.forward asks of model.KVCache, over its buffers: row b's chunk goes to [pos[b]:pos[b]+T], every
row reads the first max(pos) + T slots masked to its own keys; rows all at one position (not taken) go the plain
cache's way, unmasked, generate's floats. A fixed-shape step (a CUDA graph's) is one more answer: positions on the
device, layer(i) writing at them by index_put and reading all max_len slots masked, keys_seen max_len.
"""
import copy
import functools

import torch

from model import KVCache


class RowCache(KVCache):
    """The buffers of cache (GPT.new_kv_cache's), row b at its own position pos[b]: a LongTensor (B,) on the CPU."""

    def __init__(self, cache: KVCache):
        self.k, self.v = cache.k, cache.v
        self.pos = torch.zeros(self.k.size(1), dtype=torch.long)  # every slot at 0
        self.parent = self.slots = self.lengths = self.real = None  # take()'s, see there
        self.at = None  # positions()'s: the chunk's slots (B, T), or None for the plain path

    def rows(self, start: int, stop: int) -> "RowCache":  # the same buffers, a view of the positions
        view = copy.copy(self)
        view.k, view.v, view.pos = self.k[:, start:stop], self.v[:, start:stop], self.pos[start:stop]
        return view

    def take(self, slots: list[int], lengths: list[int]) -> "RowCache":
        """Rows slots (B, any order) for one forward of a ragged chunk (B, T), row b's first lengths[b] tokens real,
        the rest padding: only real keys are written, each row advances by its own length, last is its last real."""
        view = copy.copy(self)
        view.parent, view.pos = self, self.pos[slots]  # a copy: advance writes the parent's
        view.slots, view.lengths = torch.tensor(slots, device=self.k.device), torch.tensor(lengths)
        view.real = (torch.arange(max(lengths)) < view.lengths[:, None]).to(self.k.device)  # (B, T) bool
        return view

    @property
    def batch_size(self) -> int:
        return self.k.size(1) if self.slots is None else self.slots.numel()

    def keys_seen(self, T: int) -> int:
        """Keys the last real query attends to: max(pos) + T, or for a ragged chunk max(pos + lengths)."""
        if self.lengths is None:
            return int(self.pos.max()) + T
        if T != self.real.size(1):
            raise ValueError(f"a ragged chunk is padded to its longest row, {self.real.size(1)} tokens, not {T}")
        return int((self.pos + self.lengths).max())

    def positions(self, T: int, device) -> torch.Tensor:
        """The chunk's positions: (T,) when every row is at one position, the plain path; else (B, T), per row."""
        if self.slots is None and bool((self.pos == self.pos[0]).all()):
            self.at = None
            return torch.arange(int(self.pos[0]), int(self.pos[0]) + T, device=device)  # (T,)
        self.at = self.pos.to(device)[:, None] + torch.arange(T, device=device)  # (B, T) each new key's slot
        # a ragged chunk's padding may run past the table: its output is unused
        return self.at if self.lengths is None else self.at.clamp(max=self.max_len - 1)

    def layer(self, i: int):
        if self.at is None:  # every row at one position: the plain cache's write, the same floats as generate
            return functools.partial(self.write, self.k[i], self.v[i], int(self.pos[0]))
        return functools.partial(self.write_rows, i)

    def write_rows(self, i: int, k: torch.Tensor, v: torch.Tensor):
        """Layer i: row b's k, v (B, nkv, T, hs) go to slots at[b] (taken rows: the buffers' rows slots, real tokens
        only) -> every row's first keys_seen(T) keys, and a mask up to each query's own slot."""
        k_cache, v_cache, at, B, T = self.k[i], self.v[i], self.at, k.size(0), k.size(2)
        rows = (torch.arange(B, device=k.device) if self.slots is None else self.slots)[:, None].expand(B, T)  # (B, T)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, nkv, hs), as the buffers are indexed
        real = slice(None) if self.real is None else self.real  # (B, T) bool: (N,) rows, slots and keys
        k_cache[rows[real], :, at[real]], v_cache[rows[real], :, at[real]] = k[real], v[real]
        Tk = self.keys_seen(T)
        mask = torch.arange(Tk, device=k.device) <= at[:, :, None]  # (B, T, Tk): key j up to the query's own slot
        if self.slots is not None:  # gathered: (B, nkv, Tk, hs) x 2
            return k_cache[self.slots, :, :Tk], v_cache[self.slots, :, :Tk], mask[:, None]
        return k_cache[:, :, :Tk], v_cache[:, :, :Tk], mask[:, None]  # (B, nkv, Tk, hs) x 2, (B, 1, T, Tk)

    def advance(self, T: int):
        if self.lengths is None:
            self.pos += T  # in place, so a rows() view moves its parent's rows
            return
        self.parent.pos[self.slots.cpu()] += self.lengths  # take(): each row by its own length, in the parent

    def last(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, 1, C): a ragged row's last real token's
        if self.lengths is None:
            return x[:, -1:]
        return x[torch.arange(x.size(0), device=x.device), self.lengths.to(x.device) - 1][:, None]

    def reset(self):  # every row back to 0, in place
        self.pos.zero_()
