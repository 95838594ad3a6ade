"""Exact trim of a cache entry to the tokens it really holds.

Why: mlx-lm's caches grow in 256-slot steps (or are pre-allocated), so an entry that holds 300
tokens usually sits in 512 (or 32768) slots, and ``nbytes`` prices the *capacity*. Storing such
an entry keeps the whole buffer alive. A plain slice is a view that keeps its parent buffer
alive too, so trimming makes a fresh copy and evaluates it, after which dropping the original
really frees the big buffer. How each layer class is cut is the layer vocabulary's business
(:func:`kvplugin.cache.layers.trim_layer`); this module applies it to an entry.

Trim never mutates its input: changed layers are shallow copies (same class, every
version-specific attribute such as an instance ``step`` carried over) whose arrays are
replaced. Unchanged layers are returned as the same objects.
"""

from __future__ import annotations

import mlx.core as mx

from kvplugin.cache.layers import entry_arrays, trim_layer

__all__ = ["trim_entry"]


def trim_entry(cache: list) -> list:
    """Return a new list whose layers each hold exactly their used tokens.

    Exact layers are the same objects; trimmed ones are new objects of the same class. The new
    arrays are evaluated here, so that once the caller drops the original entry its oversized
    buffers are really released (a lazy copy would keep its source alive until evaluated).
    """
    out = [trim_layer(layer) for layer in cache]
    fresh = [a for new, old in zip(out, cache) if new is not old for a in entry_arrays(new)]
    if fresh:
        mx.eval(fresh)
    return out
