"""Layer layouts, by base class, and prefix copies: the first ``n`` tokens of an entry.

Why by ``isinstance``: which array fields a layer has is its base class's business, so a
subclass with only extra scalar attributes copies (and serializes) like its base.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlc

from kvplugin.cache.layers.accounting import entry_arrays, entry_tokens

__all__ = ["KNOWN_FIELDS", "can_copy_prefix", "copy_floor", "copy_prefix", "extra_scalars",
           "growth_of", "is_trimmable", "layout_of", "prefix_views"]

log = logging.getLogger("kvplugin.cache")


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
        if hasattr(layer, "can_cut"):  # a stored layer that cuts itself (a quantized ring)
            return bool(layer.can_cut(n))
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
        # a stored layer that cuts itself (a quantized ring, the codec's: shared arrays)
        out = [c.cut(n) if hasattr(c, "cut") else _copy_layer(c, n, share) for c in cache]
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
