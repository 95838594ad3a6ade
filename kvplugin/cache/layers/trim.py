"""Exact trim of a cache entry to the tokens it really holds.

Why: mlx-lm's caches grow in 256-slot steps (or are pre-allocated), so an entry that holds 300
tokens usually sits in 512 (or 32768) slots, and ``nbytes`` prices the *capacity*. Storing such
an entry keeps the whole buffer alive. A plain slice is a view that keeps its parent buffer
alive too, so trimming makes a fresh copy and evaluates it, after which dropping the original
really frees the big buffer. How each layer class is cut is the layer vocabulary's business
(:func:`kvplugin.cache.layers.trim_layer`); this module applies it to an entry.

Changed layers are shallow copies (same class, every version-specific attribute such as an
instance ``step`` carried over) whose arrays are replaced; unchanged layers are returned as the
same objects. By default the input list is left alone. ``consume=True`` (what the session uses:
a stored entry is the store's to change) replaces each layer in the input list as soon as its
trimmed copy is evaluated, so the oversized original is freed layer by layer and the transient
is one layer, not the whole entry.
"""

from __future__ import annotations

import mlx.core as mx

from kvplugin.cache.layers.kinds import trim_layer
from kvplugin.cache.layers.accounting import entry_arrays

__all__ = ["trim_entry"]


def trim_entry(cache: list, *, consume: bool = False) -> list:
    """Return a list whose layers each hold exactly their used tokens (``cache`` itself, changed
    in place, when ``consume``; a new list otherwise).

    Exact layers are the same objects; trimmed ones are new objects of the same class. The new
    arrays are evaluated here, so that once the caller drops the original entry its oversized
    buffers are really released (a lazy copy would keep its source alive until evaluated).

    An exact layer is left as it is, evaluated or not: mlx-lm's batched path hands over
    exact-size *lazy* copies of a buffer the batch still holds at insert time, and evaluating
    them here would hold both at once (docs/benchmarks.md, design decisions); left lazy, the
    copy runs at the fetch, layer by layer once the batch is gone.
    """
    out = cache if consume else list(cache)
    for i, layer in enumerate(cache):
        new = trim_layer(layer)
        if new is not layer:
            mx.eval(entry_arrays(new))
            out[i] = new  # with consume, the original layer's buffers can go now
    return out
