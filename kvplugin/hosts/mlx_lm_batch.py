"""Zero-copy seams of mlx-lm's batched path for a batch of one.

Why: mlx-lm's ``BatchGenerator`` merges every request's cache into a ``BatchKVCache`` by
allocating a new buffer and copying the cache into it (``BatchKVCache.merge``), even when
the batch holds one request whose cache already has the batch's exact layout
(``(1, heads, tokens, dim)``, no padding). On a reused conversation that copy is a whole
entry of extra memory at the moment memory is highest (stock's deepcopy on fetch is lazy,
the merge is not). A batch of one can *adopt* the cache's arrays instead: same class, same
content, same shapes, no copy. Everything else (several requests, rotating or quantized
layers, padding) goes to mlx-lm's own ``merge`` unchanged.

MLX arrays are values: the batch writes new tokens by slice assignment or by growing into a
new buffer, so adopting a buffer that a stored entry still shares never changes that entry.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["adopting_merge"]


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

    merge.__doc__ = adopting_merge.__doc__
    merge.__kvplugin_original__ = original  # type: ignore[attr-defined]
    return classmethod(merge)
