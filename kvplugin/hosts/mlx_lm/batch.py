"""Zero-copy seams of mlx-lm's batched path for a batch of one.

Why: mlx-lm's ``BatchGenerator`` merges every request's cache into a ``BatchKVCache`` by
allocating a new buffer and copying the cache into it (``BatchKVCache.merge``), even when
the batch holds one request whose cache already has the batch's exact layout
(``(1, heads, tokens, dim)``, no padding). On a reused conversation that copy is a whole
entry of extra memory at the moment memory is highest (stock's deepcopy on fetch is lazy,
the merge is not). A batch of one can *adopt* the cache's arrays instead: same class, same
content, same shapes, no copy. Everything else (several requests, rotating or quantized
layers, padding) goes to mlx-lm's own ``merge`` unchanged.

The same holds for the two other whole-cache copies of a batch of one on mlx-lm >= 0.31's
``BatchGenerator`` (what vllm-mlx's ``--continuous-batching`` drives):

* ``PromptProcessingBatch.split`` (prompt -> generation) shares the arrays
  (``copy.deepcopy`` of an MLX array is the same array) and then calls ``filter([0])`` on the
  new batch: ``keys[[0]]`` is a gather, a full copy. Keeping every row in order is a slice
  (a view): :func:`whole_batch_filter`.
* ``extract`` at the end of a request copies the row to a contiguous buffer
  (``mx.contiguous``) while the batch's buffer is still alive. A batch of one can hand out
  its buffer as a plain ``KVCache`` (``offset`` = tokens held, slack after it, as a
  ``KVCache`` normally has): :func:`adopting_extract`. The store trims it layer by layer.

MLX arrays are values: the batch writes new tokens by slice assignment or by growing into a
new buffer, so adopting a buffer that a stored entry still shares never changes that entry
(a shared buffer is not donated: the first write after sharing copies it once, as stock did).
"""

from __future__ import annotations

from typing import Any, Callable

from kvplugin.hosts.base import wraps_original

__all__ = ["adopting_extract", "adopting_merge", "whole_batch_filter"]


def _adoptable(cache: Any, kv_cache_cls: type) -> bool:
    keys = getattr(cache, "keys", None)
    return (
        type(cache) is kv_cache_cls
        and keys is not None
        and getattr(cache, "values", None) is not None
        and keys.ndim == 4
        and keys.shape[0] == 1
        and 0 < int(cache.offset) <= keys.shape[2]
    )


def adopting_merge(original: Callable, kv_cache_cls: type) -> classmethod:
    """``BatchKVCache.merge`` that adopts a single plain ``KVCache`` instead of copying it.

    ``original`` is the class's own ``merge`` function (unbound); the result is installed as a
    classmethod through the adapter's patch registry.
    """

    @wraps_original(original)
    def merge(cls: type, caches: list) -> Any:
        if len(caches) != 1 or not _adoptable(caches[0], kv_cache_cls):
            return original(cls, caches)
        cache = caches[0]
        n = int(cache.offset)
        batch = cls([0])
        # Exactly the tokens held: a view when the buffer has free slots (kept alive only
        # until the batch grows into a new buffer), else the very same arrays.
        batch.keys = cache.keys if cache.keys.shape[2] == n else cache.keys[..., :n, :]
        batch.values = cache.values if cache.values.shape[2] == n else cache.values[..., :n, :]
        batch.offset = batch.offset + n
        batch._idx = n
        return batch

    return classmethod(merge)


def _keeps_every_row(cache: Any, batch_indices: Any) -> bool:
    rows = getattr(getattr(cache, "offset", None), "shape", None)
    return (
        isinstance(batch_indices, (list, tuple))
        and rows is not None
        and len(rows) == 1
        and list(batch_indices) == list(range(rows[0]))
    )


def whole_batch_filter(original: Callable) -> Callable:
    """``BatchKVCache.filter`` that keeps every row in order as a slice (a view), not a gather.

    ``original`` is the class's own ``filter``; any other selection goes to it unchanged.
    """

    @wraps_original(original)
    def filter(self: Any, batch_indices: Any) -> None:
        if _keeps_every_row(self, batch_indices):
            return original(self, slice(None))
        return original(self, batch_indices)

    return filter


def adopting_extract(original: Callable, kv_cache_cls: type) -> Callable:
    """``BatchKVCache.extract`` that hands a batch of one its own buffer as a ``KVCache``.

    Several rows (the others go on) or an empty batch take mlx-lm's own ``extract``.
    """

    @wraps_original(original)
    def extract(self: Any, idx: int) -> Any:
        keys = self.keys
        if keys is None or keys.ndim != 4 or keys.shape[0] != 1 or idx != 0:
            return original(self, idx)
        padding = int(self.left_padding[0].item())
        n = int(self._idx) - padding
        if n <= 0:
            return original(self, idx)
        cache = kv_cache_cls()
        cache.keys = keys if padding == 0 else keys[..., padding:, :]
        cache.values = self.values if padding == 0 else self.values[..., padding:, :]
        cache.offset = n
        return cache

    return extract
