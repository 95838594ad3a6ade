"""Exact trim of KV cache entries to the tokens they really hold.

Why: mlx-lm's caches grow in 256-slot steps (or are pre-allocated), so an entry that holds 300
tokens usually sits in 512 (or 32768) slots, and ``nbytes`` prices the *capacity*. Storing such
an entry keeps the whole buffer alive. A plain slice (``keys[..., :offset, :]``) is a view that
keeps its parent buffer alive too, so trimming must make a fresh copy (``mx.contiguous`` of the
slice does) and evaluate it, after which dropping the original really frees the big buffer.

Rules:
- ``KVCache``: fresh copy of ``[..., :offset, :]``.
- ``QuantizedKVCache``: the same for each component (packed, scales, biases).
- ``RotatingKVCache`` (and ``PreallocatedRotatingKVCache``): never wrapped (``offset <
  max_size``): like ``KVCache``. Wrapped: after a multi-token prefill the stock class keeps up to
  ``max_size + L - 1`` slots in temporal order; only ``keep`` + the newest ``max_size - keep`` of
  them can ever be attended again (the next update trims to exactly that), so the trimmed entry
  keeps those ``max_size`` slots in temporal order with ``_idx = max_size``, which is the state
  the stock class itself reaches on its next one-token update: the result behaves identically.
  A wrapped buffer of exactly ``max_size`` slots is already minimal and is left as it is.
  Anything unexpected (inconsistent ``_idx``) is returned unchanged rather than guessed at.
- Every other layer kind (``ArraysCache``, ``CacheList``, ``ChunkedKVCache``, …): unchanged.

Trim never mutates its input: changed layers are shallow copies (``copy.copy``: same class,
every version-specific attribute such as an instance ``step`` carried over) whose arrays are
replaced. Unchanged layers are returned as the same objects.

Imports only ``mlx.core`` and ``mlx_lm.models.cache``; works on mlx-lm 0.31.3 and 0.32.x.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvplugin.cache.prealloc import PreallocatedRotatingKVCache

__all__ = [
    "trim_entry", "trim_layer", "is_exact", "entry_arrays", "entry_nbytes", "entry_tokens",
    "with_headroom", "key_for_cache",
]

# Exact types only: a subclass (e.g. a host's own) may give ``offset`` another meaning.
_PLAIN = (KVCache,)
_QUANT = (QuantizedKVCache,)
_ROTATING = (RotatingKVCache, PreallocatedRotatingKVCache)


def _fresh(pieces: list[mx.array]) -> mx.array:
    """A new array owning its memory, made of ``pieces`` joined along the sequence axis."""
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


def is_exact(layer: Any) -> bool:
    """True when trimming would not change ``layer`` (it holds no unused slots).

    Layer kinds trim does not handle count as exact: there is nothing trim would do to them.
    """
    t = type(layer)
    if t not in _PLAIN + _QUANT + _ROTATING:
        return True
    size = _seq_len(layer)
    if size is None:
        return True
    if t in _ROTATING:
        return size <= layer.max_size if layer.offset >= layer.max_size else size == layer.offset
    return size == layer.offset


def _empty_like(layer: Any) -> Any:
    new = copy.copy(layer)
    new.keys = None
    new.values = None
    if type(new) in _ROTATING:
        new._idx = 0
    return new


def _trim_rotating(layer: Any) -> Any:
    keys, values = layer.keys, layer.values
    size, offset, max_size, keep = keys.shape[2], layer.offset, layer.max_size, layer.keep
    new = copy.copy(layer)
    if offset < max_size:
        # Never wrapped: slots [0, offset) are the tokens, in order, and _idx == offset.
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
    # Post-prefill: buffer in temporal order. Keep the `keep` sink tokens + the newest rest.
    tail = size - (max_size - keep)
    new.keys = _fresh([keys[..., :keep, :], keys[..., tail:, :]])
    new.values = _fresh([values[..., :keep, :], values[..., tail:, :]])
    new._idx = max_size
    return new


def trim_layer(layer: Any) -> Any:
    """Trim one layer (see module docstring). Returns ``layer`` itself when nothing changes.

    The returned arrays are lazy; :func:`trim_entry` evaluates them all at once.
    """
    if is_exact(layer):
        return layer
    t = type(layer)
    if layer.offset <= 0:
        return _empty_like(layer)
    if t in _ROTATING:
        return _trim_rotating(layer)
    n = layer.offset
    new = copy.copy(layer)
    if t in _QUANT:
        new.keys = tuple(_fresh([x[..., :n, :]]) for x in layer.keys)
        new.values = tuple(_fresh([x[..., :n, :]]) for x in layer.values)
    else:
        new.keys = _fresh([layer.keys[..., :n, :]])
        new.values = _fresh([layer.values[..., :n, :]])
    return new


def _arrays_of(obj: Any, seen: set[int] | None = None) -> list[mx.array]:
    """Every distinct ``mx.array`` an object holds (attributes, nested containers/caches)."""
    seen = set() if seen is None else seen
    out: list[mx.array] = []

    def walk(x: Any) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for y in vars(x).values():
                walk(y)

    walk(obj)
    return out


def trim_entry(cache: list) -> list:
    """Return a new list whose layers each hold exactly their used tokens.

    Exact layers are the same objects; trimmed ones are new objects of the same class. The new
    arrays are evaluated here, so that once the caller drops the original entry its oversized
    buffers are really released (a lazy copy would keep its source alive until evaluated).
    """
    out = [trim_layer(layer) for layer in cache]
    fresh = [a for new, old in zip(out, cache) if new is not old for a in _arrays_of(new)]
    if fresh:
        mx.eval(fresh)
    return out


def entry_arrays(cache: list) -> list[mx.array]:
    """Every distinct array an entry holds (e.g. to ``mx.eval`` it or check aliasing)."""
    return _arrays_of(cache)


def entry_nbytes(cache: list) -> int:
    """Bytes of all distinct arrays the entry's layers hold (capacity, not just used slots).

    Unlike summing ``layer.nbytes`` this works for every layer kind (and empty quantized layers)
    and counts an array shared between layers once.
    """
    seen: set[int] = set()
    return sum(a.nbytes for layer in cache for a in _arrays_of(layer, seen))


def entry_tokens(cache: list) -> int:
    """Tokens the entry represents: the largest integer ``offset`` among its layers (0 if none).

    For a rotating layer this is the number of tokens processed, not the slots it holds.
    """
    best = 0
    for layer in cache:
        off = getattr(layer, "offset", None)
        if isinstance(off, int) and not isinstance(off, bool):
            best = max(best, off)
    return best


def with_headroom(cache: list, tokens: int | None = None) -> list:
    """Give a reused entry's exact plain layers room for ``tokens`` more, one layer at a time.

    Why: a trimmed entry has no free slot, so the first token after a reuse makes *every*
    layer grow by concatenation inside one forward pass — old and new buffers of all layers
    alive together, 2x the entry, exactly the spike move-not-copy is meant to avoid. Growing
    here, layer by layer with an ``mx.eval`` in between, bounds the transient to the entry
    plus one layer's old buffer: the peak is what is held afterwards + 1/L of the entry,
    where growing every layer at once holds it + the whole entry. ``tokens`` defaults to
    each layer's growth ``step`` (256 unless ``--kv-cache-step`` set it). Mutates and returns
    ``cache``; the caller owns it (a moved or copied entry). Other layer kinds: untouched.
    """
    for layer in cache:
        if type(layer) not in _PLAIN or layer.keys is None:
            continue
        n = int(layer.offset)
        room = int(tokens if tokens is not None else getattr(layer, "step", 256))
        if room <= 0 or layer.keys.shape[2] - n >= room:
            continue
        grown = []
        for old in (layer.keys, layer.values):
            shape = (*old.shape[:2], n + room, old.shape[3])
            new = mx.zeros(shape, dtype=old.dtype)
            new[..., :n, :] = old[..., :n, :]
            grown.append(new)
        mx.eval(grown)
        layer.keys, layer.values = grown
    return cache


def key_for_cache(cache: list, tokens: list[int]) -> list[int] | None:
    """The store key that matches what ``cache`` really holds, or ``None`` to skip storing.

    Hosts key an entry by the tokens they fed; a cache may hold fewer (an unreported
    prefill) or more (an EOS fed but not returned). Cut the key, or trim the cache when it
    is trimmable, rather than store an entry whose key lies about its contents — a wrong key
    would hand one conversation's KV to another.
    """
    held = entry_tokens(cache)
    if held == len(tokens):
        return tokens
    if held <= 0:
        return None
    if held < len(tokens):
        return tokens[:held]
    if all(getattr(c, "is_trimmable", lambda: False)() for c in cache):
        for c in cache:
            c.trim(held - len(tokens))
        return tokens
    return None
