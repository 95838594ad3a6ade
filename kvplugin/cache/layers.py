"""The layer vocabulary: the one module that knows mlx-lm's cache classes.

Why one module: trimming, pricing, quantizing, prefix copies and the cold tier each need to
know, per cache class, how many tokens a layer holds, where its arrays are, whether it can be
cut to a prefix, trimmed exactly or quantized. Written once here, a new class (a chunked,
recurrent, MLA or batch variant) is taught to kvplugin in one place.

Two ways of naming a layer, on purpose:

* its **kind** (:class:`LayerKind`, looked up by *exact* class in :data:`KINDS`): what kvplugin
  may do that depends on the meaning of ``offset`` and the buffer layout: exact trim, growth
  headroom, quantization. A subclass (a host's own) may give ``offset`` another meaning, so it
  gets nothing until registered with :func:`register_kind`.
* its **layout** (:func:`layout_of`, by ``isinstance`` against mlx-lm's base classes): which
  array fields it has, for prefix copies and (de)serialisation (``kvplugin.cache.tiers.serialize``),
  where a subclass with only extra *scalar* attributes is as portable as its base.

Everything here works on one entry (a list of layers) or one layer and never mutates its input
unless the docstring says so. Imports only ``mlx.core`` and ``mlx_lm.models.cache``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlc
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.codecs import VALUE_BITS_ATTR

__all__ = [
    "KINDS", "KNOWN_FIELDS", "LayerKind", "can_copy_prefix", "copy_floor", "copy_prefix",
    "dense_nbytes", "entry_arrays", "entry_nbytes", "entry_tokens", "extra_scalars", "is_exact",
    "is_quantizable", "is_trimmable", "layer_bits", "layout_of", "register_kind",
    "copy_lent", "lend_view", "snapshot", "trim_layer", "with_children",
]

log = logging.getLogger("kvplugin.cache")

# ----------------------------------------------------------------------- accounting


def entry_arrays(obj: Any, seen: set[int] | None = None) -> list[mx.array]:
    """Every distinct ``mx.array`` an object holds (attributes, nested containers/caches).

    A loop over an explicit stack, not a recursive closure: a closure that refers to itself
    is a reference cycle, and the cell holding the result list kept every visited array
    alive until Python's cycle collector ran (whole entries outliving their release).
    """
    seen = set() if seen is None else seen
    out: list[mx.array] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            stack.extend(reversed(list(vars(x).values())))
    return out


def entry_nbytes(cache: list) -> int:
    """Bytes of all distinct arrays the entry's layers hold (capacity, not just used slots).

    Unlike summing ``layer.nbytes`` this works for every layer kind (and empty quantized
    layers) and counts an array shared between layers once.
    """
    seen: set[int] = set()
    return sum(a.nbytes for layer in cache for a in entry_arrays(layer, seen))


def entry_tokens(cache: list) -> int | None:
    """Tokens the entry represents: the largest integer ``offset`` among its layers, nested
    ``CacheList`` children included; ``None`` when no layer records one.

    For a rotating layer this is the number of tokens processed, not the slots it holds.
    Recurrent-state layers (``ArraysCache``: Mamba, the linear layers of Qwen3-Next) hold a
    fixed-size state and no token count at all: an entry made only of them cannot say how
    many tokens it holds, and the host's token list is what keys it (``None``).
    """
    best: int | None = None
    stack = list(cache)
    while stack:
        layer = stack.pop()
        children = getattr(layer, "caches", None)
        if isinstance(children, (list, tuple)):
            stack.extend(children)
            continue
        off = getattr(layer, "offset", None)
        if isinstance(off, int) and not isinstance(off, bool):
            best = off if best is None else max(best, off)
    return best


def layer_bits(layer: Any) -> int | None:
    """The quantization bits of a quantized layer, ``None`` for a full-precision one."""
    bits = getattr(layer, "bits", None)
    return bits if isinstance(bits, int) and not isinstance(bits, bool) else None


def dense_nbytes(layer: Any) -> int:
    """Bytes the layer's used tokens take in full precision (its own bytes if not quantized)."""
    bits = layer_bits(layer)
    keys = getattr(layer, "keys", None)
    if bits is None or not isinstance(keys, (tuple, list)) or not keys:
        try:
            return int(layer.nbytes)
        except Exception:
            return 0
    total = 0
    scales = keys[1] if len(keys) > 1 else None
    dtype_size = scales.dtype.size if scales is not None else 2
    value_bits = getattr(layer, VALUE_BITS_ATTR, bits)  # K/V-asymmetric widths
    for parts, width in ((layer.keys, bits), (layer.values, value_bits)):
        *lead, slots, packed_dim = parts[0].shape  # slots held (a trimmed entry: its tokens)
        count = slots * (packed_dim * 32 // width)
        for d in lead:
            count *= d
        total += count * dtype_size
    return total


# ----------------------------------------------------------------------- kinds (exact class)


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


# ----------------------------------------------------------------------- layouts (isinstance)

_SCALARS = (int, float, bool, str, type(None))
_LAYOUTS = ("CacheList", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache", "KVCache",
            "ConcatenateKVCache", "ArraysCache")

# array-holding (and scalar) attributes each layout is known to have
KNOWN_FIELDS = {
    "KVCache": ("keys", "values", "offset"),
    "ConcatenateKVCache": ("keys", "values", "offset"),
    "QuantizedKVCache": ("keys", "values", "offset", "group_size", "bits"),
    "RotatingKVCache": ("keys", "values", "offset", "keep", "max_size", "_idx"),
    "ChunkedKVCache": ("keys", "values", "offset", "chunk_size", "start_position"),
    "ArraysCache": ("cache", "left_padding", "lengths"),
    "CacheList": ("caches",),
}


def layout_of(layer: Any) -> str | None:
    """Name of the mlx-lm base class whose layout ``layer`` has (None: unknown)."""
    for name in _LAYOUTS:
        cls = getattr(_mlc, name, None)
        if cls is not None and isinstance(layer, cls):
            return name
    return None


def extra_scalars(layer: Any, layout: str) -> dict | None:
    """Instance attributes beyond ``KNOWN_FIELDS[layout]`` (e.g. an instance ``step``).
    None if any of them is not a plain scalar (then the layer is not portable). Those the
    class names in ``TRANSIENT_ATTRS`` (live state a copy or a stored entry does not carry,
    such as a bounded layer's undo log) are left out."""
    skip = (*KNOWN_FIELDS[layout], *getattr(type(layer), "TRANSIENT_ATTRS", ()))
    extra = {}
    for k, v in getattr(layer, "__dict__", {}).items():
        if k in skip:
            continue
        if not isinstance(v, _SCALARS):
            return None
        extra[k] = v
    return extra


def growth_of(layer: Any) -> list[tuple[int, int, int | None]]:
    """How a layer's memory grows, children of a ``CacheList`` too: ``(bytes per held token,
    fixed bytes, most tokens held)`` each. Recurrent state (``ArraysCache``) is fixed; a window
    holds at most ``max_size`` tokens; K/V arrays are priced per token slot from a layer that
    holds some (admission control probes a fresh cache with a few tokens)."""
    layout = layout_of(layer)
    if layout == "CacheList":
        return [g for child in layer.caches for g in growth_of(child)]
    if layout == "ArraysCache":
        return [(0, sum(a.nbytes for a in entry_arrays([layer])), None)]
    per_slot = sum(a.nbytes // a.shape[2] for a in entry_arrays([layer])
                   if a.ndim == 4 and a.shape[2] > 0)
    cap = getattr(layer, "max_size", None)
    return [(per_slot, 0, cap if isinstance(cap, int) else None)]


def is_trimmable(cache: list) -> bool:
    """True if every layer can be trimmed (mlx-lm ``can_trim_prompt_cache``)."""
    try:
        return bool(cache) and all(c.is_trimmable() for c in cache)
    except Exception:
        return False


def _seq_prefix(x: Any, n: int, share: bool = False) -> Any:
    """Positions ``[:n]`` along axis -2 of x (array or list): fresh arrays, or views of x's
    buffer when ``share``."""
    cut = (lambda a: a[..., :n, :]) if share else (lambda a: mx.array(a[..., :n, :]))
    if isinstance(x, (list, tuple)):
        return type(x)(cut(a) for a in x)
    return cut(x)


def _copy_layer(layer: Any, n: int, share: bool = False) -> Any:
    layout = layout_of(layer)
    if layout is None or layout == "ArraysCache" or not layer.is_trimmable():
        return None
    extra = extra_scalars(layer, layout)
    if extra is None:
        return None
    new = type(layer).__new__(type(layer))
    if layout == "CacheList":
        kids = [_copy_layer(c, n, share) for c in layer.caches]
        if any(k is None for k in kids):
            return None
        new.__dict__.update(extra)
        new.caches = type(layer.caches)(kids) if isinstance(layer.caches, tuple) else kids
        return new
    offset = layer.offset
    if n > offset:
        return None
    new.__dict__.update(extra)
    for f in KNOWN_FIELDS[layout]:
        if f not in ("keys", "values"):
            setattr(new, f, getattr(layer, f))
    m = n
    if layout == "ChunkedKVCache":
        if not _chunk_cut_ok(layer, n):
            return None
        m = n - layer.start_position
    elif layout == "RotatingKVCache":
        if layer._idx != offset:  # not in temporal order
            return None
        new._idx = n
    if layer.keys is None:
        if n:
            return None
        new.keys = new.values = None
    else:
        new.keys = _seq_prefix(layer.keys, m, share)
        new.values = _seq_prefix(layer.values, m, share)
    new.offset = n
    return new


def _chunk_cut_ok(layer: Any, n: int) -> bool:
    """Whether a chunked layer cut at ``n`` still holds what the next token attends to.

    Why not ``n >= start_position``: the token at ``n`` attends to every earlier token of its
    own chunk, from ``n // chunk_size * chunk_size`` on; a layer whose front was trimmed past
    that point (``maybe_trim_front`` keeps the newest ``chunk_size``) has lost them.
    """
    return layer.start_position <= n // layer.chunk_size * layer.chunk_size


def copy_floor(cache: list) -> int | None:
    """The fewest leading tokens :func:`copy_prefix` can give of ``cache`` (every longer prefix
    up to its length too), or None when no prefix can be copied (recurrent state, a wrapped
    window). Why: a longer entry replaces a shorter one only if it serves what that one did."""
    held = entry_tokens(cache)
    if not held:
        return None
    floor = 1
    stack = list(cache)
    while stack:
        layer = stack.pop()
        if layout_of(layer) == "CacheList":
            stack.extend(layer.caches)
        elif layout_of(layer) == "ChunkedKVCache" and layer.start_position > 0:
            size = layer.chunk_size
            floor = max(floor, -(-layer.start_position // size) * size)
    return floor if floor <= held and can_copy_prefix(cache, floor) else None


def can_copy_prefix(cache: list, n: int) -> bool:
    """Cheap check whether :func:`copy_prefix` would succeed (no copying)."""

    def ok(layer: Any) -> bool:
        layout = layout_of(layer)
        if layout is None or layout == "ArraysCache" or extra_scalars(layer, layout) is None:
            return False
        if not layer.is_trimmable():
            return False
        if layout == "CacheList":
            return all(ok(c) for c in layer.caches)
        if n > layer.offset:
            return False
        if layout == "ChunkedKVCache":
            return _chunk_cut_ok(layer, n)
        if layout == "RotatingKVCache":
            return layer._idx == layer.offset
        return True

    try:
        return bool(cache) and n >= 1 and all(ok(c) for c in cache)
    except Exception:
        return False


def copy_prefix(cache: list, n: int, *, share: bool = False) -> list | None:
    """A new entry holding the first ``n`` positions of ``cache``. None if some layer cannot
    be copied.

    By default in fresh, exact-size, evaluated arrays (no buffer shared with ``cache``): for a
    source that is about to be dropped (a cold-tier file), so its big buffer is released.
    ``share=True`` gives views of ``cache``'s buffers instead, which cost no memory: for a
    source that stays stored anyway (a hot donor). MLX arrays are values, so whoever writes
    to a view gets a new buffer and the donor is never changed; and an exact-size view has
    no free slot, so the first write grows into a new buffer rather than copying the view.
    """
    try:
        out = [_copy_layer(c, n, share) for c in cache]
    except Exception:
        log.debug("copy_prefix failed", exc_info=True)
        return None
    if not out or any(c is None for c in out):
        return None
    if not share:
        mx.eval(entry_arrays(out))
    return out


def prefix_views(cache: list, n: int) -> list:
    """Each layer's first ``n`` positions as views (no bytes copied), ``None`` for a layer
    that cannot give them (recurrent state, a wrapped window): what a codec may copy rows
    from, where :func:`copy_prefix` would refuse the whole entry for one such layer."""
    out = []
    for layer in cache:
        try:
            out.append(_copy_layer(layer, n, share=True))
        except Exception:
            out.append(None)
    return out


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
