"""Lending: what the store keeps of an entry it moved out, to copy from for a concurrent
request that wants the same prefix (stock deep-copies for both).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvplugin.cache.layers.prefix import _copy_layer, layout_of

__all__ = ["copy_lent", "lend_view", "snapshot"]

log = logging.getLogger("kvplugin.cache")

def _view(x: Any) -> Any:
    if isinstance(x, mx.array):
        return x[...]  # a new array object on the same buffer
    if isinstance(x, (list, tuple)):
        return type(x)(_view(v) for v in x)
    if layout_of(x) is not None:
        return _snapshot_layer(x)
    return x


def _snapshot_layer(layer: Any) -> Any:
    new = copy.copy(layer)
    for k, v in vars(layer).items():
        setattr(new, k, _view(v))
    return new


def snapshot(cache: list) -> list:
    """A new entry with the values ``cache`` holds now, at no memory cost, for every layer
    kind (recurrent state, wrapped windows and ``CacheList`` included).

    Why: an entry moved to one request is written by it in place, yet a second request may
    want the same prefix meanwhile (stock deep-copies for both). Every array here is a new
    array object on the same buffer: MLX writes in place only into a buffer nobody else
    holds, so the owner's first write into a shared buffer copies it (the cost stock pays
    up front) and this snapshot keeps the old values. Scalars are copied.
    """
    return [_snapshot_layer(c) for c in cache]


# exact classes whose first ``offset`` positions never change once written: they only grow by
# appending (in place or by concatenation), so the owner's live layer serves any prefix later
_APPEND_ONLY = (KVCache, QuantizedKVCache)


def _lend(layer: Any) -> Any:
    if type(layer) in _APPEND_ONLY:
        return layer
    if layout_of(layer) == "CacheList":  # Falcon-H1: keep its attention child live too
        new = copy.copy(layer)
        new.caches = type(layer.caches)(_lend(c) for c in layer.caches)
        return new
    return _snapshot_layer(layer)


def lend_view(cache: list) -> list:
    """What a store keeps of an entry it moves out to a request, to copy from if a concurrent
    request wants the same prefix: append-only layers themselves (their prefix never changes,
    and holding them costs nothing), every other layer (windows that wrap in place,
    recurrent state) as a :func:`snapshot`; ``CacheList`` children alike."""
    return [_lend(layer) for layer in cache]


def _from_lent(layer: Any, n: int, whole: bool) -> Any:
    if type(layer) in _APPEND_ONLY:  # live: it may have grown since, cut it at n
        return _copy_layer(layer, n, share=True)
    if layout_of(layer) == "CacheList":
        kids = [_from_lent(c, n, whole) for c in layer.caches]
        if any(k is None for k in kids):
            return None
        new = copy.copy(layer)
        new.caches = type(layer.caches)(kids)
        return new
    if whole:
        return _snapshot_layer(layer)
    if hasattr(layer, "cut"):  # a stored layer that cuts itself (a quantized ring)
        return layer.cut(n)
    return _copy_layer(layer, n, share=True)


def copy_lent(lent: list, n: int, *, whole: bool) -> list | None:
    """A new entry from a :func:`lend_view`: its first ``n`` positions (views), or, ``whole``,
    everything it held when lent (``n`` is then its length: state and wrapped windows that
    cannot be cut are copied as they are). None if a layer cannot give that."""
    try:
        out = [_from_lent(layer, n, whole) for layer in lent]
    except Exception:
        log.debug("copy_lent failed", exc_info=True)
        return None
    return None if any(c is None for c in out) else out
