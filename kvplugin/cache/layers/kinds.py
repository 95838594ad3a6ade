"""Layer kinds, by exact class: what kvplugin may do that depends on what ``offset`` means.

Why by exact class: a host's subclass may give ``offset`` another meaning, so it gets no
exact trim or quantization until it is registered here (:func:`register_kind`), the one
extension point for a new kind.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache

__all__ = ["KINDS", "LayerKind", "is_exact", "is_quantizable", "register_kind", "trim_layer",
           "with_children"]



@dataclass(frozen=True)
class LayerKind:
    """What kvplugin may do with layers of one exact class.

    ``exact(layer)``: holds no unused slots. ``trim(layer)``: a copy holding exactly the used
    tokens, lazy (``layer`` itself when it cannot be shortened safely). ``growable``:
    it grows by concatenation. ``quantizable``: the quantize codec may turn it
    into a ``QuantizedKVCache``.
    """

    name: str
    exact: Callable[[Any], bool]
    trim: Callable[[Any], Any]
    growable: bool = False
    quantizable: bool = False


def _fresh(pieces: list[mx.array]) -> mx.array:
    """A new array owning its memory, made of ``pieces`` joined along the sequence axis.

    A plain slice is a view that keeps its parent buffer alive, hence the copy.
    """
    pieces = [p for p in pieces if p.shape[2] > 0] or pieces[:1]
    if len(pieces) == 1:
        return mx.contiguous(pieces[0])
    return mx.concatenate(pieces, axis=2)


def _seq_len(layer: Any) -> int | None:
    """Slots held along the sequence axis, or None when the layer holds no arrays."""
    keys = getattr(layer, "keys", None)
    if keys is None:
        return None
    if isinstance(keys, (tuple, list)):
        return int(keys[0].shape[-2])
    return int(keys.shape[2])


def _exact_linear(layer: Any) -> bool:
    size = _seq_len(layer)
    return size is None or size == layer.offset


def _exact_rotating(layer: Any) -> bool:
    size = _seq_len(layer)
    if size is None:
        return True
    return size <= layer.max_size if layer.offset >= layer.max_size else size == layer.offset


def _empty_like(layer: Any) -> Any:
    new = copy.copy(layer)
    new.keys = None
    new.values = None
    if isinstance(new, RotatingKVCache):
        new._idx = 0
    return new


def _trim_plain(layer: Any) -> Any:
    if layer.offset <= 0:
        return _empty_like(layer)
    n, new = layer.offset, copy.copy(layer)
    new.keys = _fresh([layer.keys[..., :n, :]])
    new.values = _fresh([layer.values[..., :n, :]])
    return new


def _trim_quantized(layer: Any) -> Any:
    if layer.offset <= 0:
        return _empty_like(layer)
    n, new = layer.offset, copy.copy(layer)
    new.keys = tuple(_fresh([x[..., :n, :]]) for x in layer.keys)
    new.values = tuple(_fresh([x[..., :n, :]]) for x in layer.values)
    return new


def _trim_rotating(layer: Any) -> Any:
    """Never wrapped: like ``KVCache``. Wrapped after a multi-token prefill (up to
    ``max_size + L - 1`` slots in temporal order): keep ``keep`` + the newest
    ``max_size - keep`` with ``_idx = max_size``, the state the stock class reaches on its next
    one-token update, so the result behaves identically. Anything unexpected: unchanged."""
    if layer.offset <= 0:
        return _empty_like(layer)
    keys, values = layer.keys, layer.values
    size, offset, max_size, keep = keys.shape[2], layer.offset, layer.max_size, layer.keep
    new = copy.copy(layer)
    if offset < max_size:
        if layer._idx != offset:
            return layer
        new.keys = _fresh([keys[..., :offset, :]])
        new.values = _fresh([values[..., :offset, :]])
        new._idx = offset
        return new
    if size <= max_size:
        return layer  # wrapped in place: exactly max_size slots, already minimal
    if layer._idx != size or not 0 <= keep < max_size:
        return layer  # not the post-prefill layout we know how to shorten exactly
    tail = size - (max_size - keep)
    new.keys = _fresh([keys[..., :keep, :], keys[..., tail:, :]])
    new.values = _fresh([values[..., :keep, :], values[..., tail:, :]])
    new._idx = max_size
    return new


def _exact_chunked(layer: Any) -> bool:
    size = _seq_len(layer)
    return size is None or size == layer.offset - layer.start_position


def _trim_chunked(layer: Any) -> Any:
    """Llama 4's chunked attention holds tokens ``start_position..offset`` in slots
    ``0..offset - start_position``; the rest is growth slack, cut like a plain layer's."""
    used, new = layer.offset - layer.start_position, copy.copy(layer)
    if used <= 0:
        return layer
    new.keys = _fresh([layer.keys[..., :used, :]])
    new.values = _fresh([layer.values[..., :used, :]])
    return new


def _exact_list(layer: Any) -> bool:
    return all(is_exact(child) for child in layer.caches)


def with_children(layer: Any, children: list) -> Any:
    """A new ``CacheList`` like ``layer`` holding ``children`` (its scalars kept)."""
    new = copy.copy(layer)
    new.caches = type(layer.caches)(children) if isinstance(layer.caches, tuple) else children
    return new


def _trim_list(layer: Any) -> Any:
    """Falcon-H1's ``CacheList`` (recurrent state + attention): its children trimmed; the
    attention child otherwise keeps its 256-slot growth slack in the store."""
    return with_children(layer, [trim_layer(child) for child in layer.caches])


KINDS: dict[type, LayerKind] = {}


def register_kind(cls: type, kind: LayerKind) -> None:
    """Teach kvplugin one more exact cache class (the extension point for new kinds)."""
    KINDS[cls] = kind


register_kind(KVCache, LayerKind("KVCache", _exact_linear, _trim_plain,
                                 growable=True, quantizable=True))
register_kind(QuantizedKVCache, LayerKind("QuantizedKVCache", _exact_linear, _trim_quantized))
register_kind(RotatingKVCache, LayerKind("RotatingKVCache", _exact_rotating, _trim_rotating))
register_kind(PreallocatedRotatingKVCache,
              LayerKind("PreallocatedRotatingKVCache", _exact_rotating, _trim_rotating))
register_kind(ChunkedKVCache, LayerKind("ChunkedKVCache", _exact_chunked, _trim_chunked))
register_kind(CacheList, LayerKind("CacheList", _exact_list, _trim_list))


def is_exact(layer: Any) -> bool:
    """True when trimming would not change ``layer`` (it holds no unused slots).

    Layer kinds trim does not handle count as exact: there is nothing trim would do to them.
    """
    kind = KINDS.get(type(layer))
    return kind is None or kind.exact(layer)


def trim_layer(layer: Any) -> Any:
    """One layer cut to its used tokens (lazy arrays); ``layer`` itself when nothing changes."""
    if is_exact(layer):
        return layer
    return KINDS[type(layer)].trim(layer)


def is_quantizable(layer: Any, group_size: int) -> bool:
    """A non-empty layer the quantize codec may turn into ``QuantizedKVCache``."""
    kind = KINDS.get(type(layer))
    return (
        kind is not None
        and kind.quantizable
        and layer.keys is not None
        and layer.offset > 0
        and layer.keys.shape[-1] % group_size == 0
        and layer.values.shape[-1] % group_size == 0
    )
