"""A batch rotating cache that keeps every row's first tokens, as ``RotatingKVCache(n, keep)`` does.

Why: mlx-lm's batched path runs bounded layers in ``BatchRotatingKVCache``, which keeps no first
tokens, while its sequential path (and ``mlx_lm.generate --max-kv-size``) uses
``RotatingKVCache(n, keep=4)``. Once a conversation passes the bound the model loses its
attention sinks on one path and not the other: one request, two answers depending on how the
server scheduled it. mlx-lm 0.31 refuses ``keep > 0`` in a batch outright.

How, without rewriting mlx-lm's ring (per-row left padding, right-padded prefill, rolls, merge,
extend, filter all stay the stock code): the ring is a stock ``BatchRotatingKVCache`` of
``n - keep`` slots, and each row's first ``keep`` tokens are copied aside (``sink_keys``) as
they arrive. While no row has lost a token the ring alone is exactly the stock bounded cache
(nothing is concatenated, nothing is masked differently). From the update on which the ring
could drop a row's first tokens, the ring treats those first tokens as left padding (masked
wherever they still sit in it) and attention gets ``[sinks, ring]``: ``keep`` + the newest
``n - keep`` tokens, as ``RotatingKVCache(n, keep)``. The mask reproduces the sequential cache's
exactly, including its column window during a multi-token chunk (a chunk's later queries stop
seeing the kept tokens there, because the stock cache windows by buffer column).

Price: once a row is past the bound every step concatenates the sinks in front of the ring (a
copy of one layer's cache at a time); before that, nothing.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

__all__ = ["KeepingBatchRotatingKVCache"]


class KeepingBatchRotatingKVCache(BatchRotatingKVCache):
    """``BatchRotatingKVCache`` whose rows answer like ``RotatingKVCache(bound, keep)``.

    ``max_size`` is the ring's (``bound - keep``: the stock code reads it); ``bound`` is the
    bound a row holds. ``sinks_on``: the ring masks each row's first ``keep`` tokens and
    attention gets the sinks in front.
    """

    #: what :meth:`extract` gives back: the class the rows were merged from (set by
    #: :meth:`merge`; the batch never names it, so the row class may import this one)
    row_class: type = RotatingKVCache

    def __init__(self, bound: int, left_padding: Sequence[int], keep: int = 4):
        if not 0 < keep < bound - 1:
            raise ValueError(f"need 0 < keep < bound - 1, got keep={keep}, bound={bound}")
        super().__init__(bound - keep, list(left_padding))
        self.bound = bound
        self.keep = keep
        self.sink_keys: mx.array | None = None
        self.sink_values: mx.array | None = None
        self.sinks_on = False
        self._sinks_full = False  # every row's first `keep` tokens are captured

    # -- the first tokens, copied aside as they arrive --------------------------------------
    def _capture(self, keys: mx.array, values: mx.array) -> None:
        """Copy each row's tokens ``[0, keep)`` present in this update into the sinks."""
        B, H, S, _ = keys.shape
        if self.sink_keys is None:
            self.sink_keys = mx.zeros((B, H, self.keep, keys.shape[3]), keys.dtype)
            self.sink_values = mx.zeros((B, H, self.keep, values.shape[3]), values.dtype)
        cols = mx.arange(self.keep)[None, :] - self.offset[:, None]  # (B, keep) chunk column
        here = ((cols >= 0) & (cols < S))[:, None, :, None]
        idx = mx.clip(cols, 0, S - 1)[:, None, :, None]
        self.sink_keys = mx.where(here, mx.take_along_axis(keys, idx, axis=2), self.sink_keys)
        self.sink_values = mx.where(here, mx.take_along_axis(values, idx, axis=2),
                                    self.sink_values)
        if self._lengths is None:  # right-padded chunks capture padding; real tokens come later
            self._sinks_full = bool(mx.min(self.offset + S).item() >= self.keep)

    def _needs_sinks(self, S: int) -> bool:
        """Whether the ring may drop a row's first tokens on an update of ``S`` tokens."""
        return self.sinks_on or self._offset + S > self.max_size

    def _turn_on_sinks(self) -> None:
        self.left_padding = self.left_padding + self.keep
        self.sinks_on = True

    # -- the stock interface ----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        if not self._sinks_full:
            self._capture(keys, values)
        if not self.sinks_on and self._needs_sinks(S):
            self._turn_on_sinks()
        k, v = super().update_and_fetch(keys, values)
        if not self.sinks_on:
            return k, v
        return (mx.concatenate([self.sink_keys, k], axis=2),
                mx.concatenate([self.sink_values, v], axis=2))

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or self.bound
        if not self._needs_sinks(N):
            return super().make_mask(N, window_size=window)
        saved = self.left_padding
        if not self.sinks_on:  # this forward's update turns them on: mask as it will be
            self.left_padding = saved + self.keep
        try:
            ring = super().make_mask(N, window_size=window)
        finally:
            self.left_padding = saved
        return mx.concatenate([mx.broadcast_to(self._sink_mask(N, window), ring.shape[:-1]
                                               + (self.keep,)), ring], axis=-1)

    def _sink_mask(self, N: int, window: int) -> mx.array:
        """Sink ``j`` for query ``k`` of a row with ``before`` tokens: the token exists and is
        not after the query, and ``RotatingKVCache``'s column window still covers it (its
        buffer holds ``min(before, bound - 1)`` old columns, the first ``keep`` at columns
        ``0..keep-1``)."""
        before = self.offset[:, None, None, None]
        q = mx.arange(N)[None, None, :, None]
        j = mx.arange(self.keep)[None, None, None, :]
        cols = mx.minimum(before, self.bound - 1)
        return (j <= before + q) & (cols + q - j < window)

    def is_trimmable(self) -> bool:
        return not self.sinks_on and super().is_trimmable()

    def trim(self, n: int) -> int:
        self._sinks_full = False  # trimmed first tokens are captured again when they return
        return super().trim(n)

    def size(self) -> int:
        return min(self._offset, self.bound)

    @property
    def nbytes(self) -> int:
        sinks = 0 if self.sink_keys is None else self.sink_keys.nbytes + self.sink_values.nbytes
        return super().nbytes + sinks

    @property
    def state(self):
        state = BatchRotatingKVCache.state.fget(self)
        if self.sink_keys is None:
            return state
        return (*state, self.sink_keys, self.sink_values)

    @state.setter
    def state(self, v):
        v = tuple(v)
        BatchRotatingKVCache.state.fset(self, v[:8])
        if len(v) > 8:
            self.sink_keys, self.sink_values = v[8], v[9]

    # -- batch bookkeeping ------------------------------------------------------------------
    def _sinks_like(self, other: "KeepingBatchRotatingKVCache") -> None:
        """Zero sinks for an empty cache joining one that has tokens (shape and dtype)."""
        if self.sink_keys is None and other.sink_keys is not None:
            B = self.offset.shape[0]
            self.sink_keys = mx.zeros((B,) + other.sink_keys.shape[1:], other.sink_keys.dtype)
            self.sink_values = mx.zeros((B,) + other.sink_values.shape[1:],
                                        other.sink_values.dtype)

    def filter(self, batch_indices) -> None:
        super().filter(batch_indices)
        if self.sink_keys is not None:
            self.sink_keys = self.sink_keys[batch_indices]
            self.sink_values = self.sink_values[batch_indices]

    def extend(self, other: "KeepingBatchRotatingKVCache") -> None:
        if not isinstance(other, KeepingBatchRotatingKVCache) or other.bound != self.bound:
            raise ValueError("can only extend with a KeepingBatchRotatingKVCache of the same bound")
        self._sinks_like(other)
        other._sinks_like(self)
        for c in (self, other):
            if not c.sinks_on and (self.sinks_on or other.sinks_on):
                c._turn_on_sinks()  # equivalent for a row that has lost nothing yet
        super().extend(other)
        if self.sink_keys is not None:
            self.sink_keys = mx.concatenate([self.sink_keys, other.sink_keys])
            self.sink_values = mx.concatenate([self.sink_values, other.sink_values])
        self._sinks_full = self._sinks_full and other._sinks_full

    def extract(self, idx: int) -> RotatingKVCache:
        """Row ``idx`` as the class its rows were merged from (the sequential path's
        ``PreallocatedRotatingKVCache(bound, keep)``), so a stored entry merges back into this
        class: its tokens in order while none was dropped, else its first ``keep`` and newest
        ``bound - keep`` (what that class keeps)."""
        mx.eval(self.left_padding, self.offset)
        padding = max(0, self.left_padding.tolist()[idx])
        offset = self.offset.tolist()[idx]
        cache = self.row_class(self.bound, self.keep)
        if self.keys is None:
            return cache
        k, v = self.keys[idx: idx + 1], self.values[idx: idx + 1]
        width = self._idx
        if self.rotated:
            k, v = mx.roll(k, -self._idx, axis=2), mx.roll(v, -self._idx, axis=2)
            width = k.shape[2]
        k, v = k[:, :, padding:width], v[:, :, padding:width]
        if self.sinks_on:
            n = min(self.keep, offset)
            k = mx.concatenate([self.sink_keys[idx: idx + 1, :, :n], k], axis=2)
            v = mx.concatenate([self.sink_values[idx: idx + 1, :, :n], v], axis=2)
        if k.shape[2] > self.bound or k.shape[2] < offset:
            tail = k.shape[2] - (self.bound - self.keep)
            k = mx.concatenate([k[:, :, : self.keep], k[:, :, tail:]], axis=2)
            v = mx.concatenate([v[:, :, : self.keep], v[:, :, tail:]], axis=2)
        cache.keys, cache.values = mx.contiguous(k), mx.contiguous(v)
        cache.offset = offset
        cache._idx = k.shape[2]
        return cache

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> "KeepingBatchRotatingKVCache":
        """Rows from per-request ``RotatingKVCache(bound, keep)`` layers (each whole, in
        temporal order: its first tokens, then its newest ones), right-aligned."""
        bound, keep = caches[0].max_size, caches[0].keep
        if any(c.max_size != bound or c.keep != keep for c in caches):
            raise ValueError("can only merge rotating caches with the same bound and keep")
        rows = [None if c.keys is None else (c._temporal_order(c.keys),
                                             c._temporal_order(c.values)) for c in caches]
        width = max((r[0].shape[2] for r in rows if r is not None), default=0)
        if width == 0:
            empty = cls(bound, [0] * len(caches), keep)
            empty.row_class = type(caches[0])
            return empty
        padding = [width - (0 if r is None else r[0].shape[2]) for r in rows]
        k0, v0 = next(r for r in rows if r is not None)
        B, H = len(caches), k0.shape[1]
        keys = mx.zeros((B, H, width, k0.shape[3]), k0.dtype)
        values = mx.zeros((B, H, width, v0.shape[3]), v0.dtype)
        sink_k = mx.zeros((B, H, keep, k0.shape[3]), k0.dtype)
        sink_v = mx.zeros((B, H, keep, v0.shape[3]), v0.dtype)
        for i, (p, r) in enumerate(zip(padding, rows)):
            if r is None:
                continue
            keys[i: i + 1, :, p:] = r[0]
            values[i: i + 1, :, p:] = r[1]
            n = min(keep, r[0].shape[2])
            sink_k[i: i + 1, :, :n] = r[0][..., :n, :]
            sink_v[i: i + 1, :, :n] = r[1][..., :n, :]
        cache = cls(bound, padding, keep)
        cache.row_class = type(caches[0])
        cache.keys, cache.values = keys, values
        cache.sink_keys, cache.sink_values = sink_k, sink_v
        cache.offset = mx.array([c.offset for c in caches])
        cache._idx = cache._offset = width
        cache._sinks_full = all(c.offset >= keep for c in caches)
        return cache
