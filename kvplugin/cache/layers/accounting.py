"""What an entry holds and costs: its arrays, bytes and tokens, for every layer kind.

Why apart: pricing an entry (the store's budget, reports, the codec's byte counts) must work
for layers kvplugin has never seen (a host's subclass, a nested list), so it walks objects
rather than asking each class.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvplugin.codecs import RING_SLOTS_ATTR, VALUE_BITS_ATTR

__all__ = ["dense_nbytes", "entry_arrays", "entry_nbytes", "entry_tokens", "layer_bits"]



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
        slots = getattr(layer, RING_SLOTS_ATTR, slots)  # a ring's protected slots, not coded
        count = slots * (packed_dim * 32 // width)
        for d in lead:
            count *= d
        total += count * dtype_size
    return total
