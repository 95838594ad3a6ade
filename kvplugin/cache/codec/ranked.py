"""Key bits by layer: the layers whose keys the codec quantizes worst get more bits, paid for
by the layers it quantizes best, at no more stored bytes.

Why: a few layers' keys carry most of the 4-bit error, and which ones depends on the model
and the entry (bounded SmolLM2: one layer in 30 gave 40% of the KL, Gemma 3: two of its
three global layers; docs/benchmarks.md, "Key bits by layer"). The ranking needs no
calibration: per-channel keys are quantized to a step of ``range / levels`` over each group
of tokens, so a layer's key error goes with its keys' spread over those groups, measured on
a sample of the entry's own rows (:func:`key_spread`). It found exactly the layers whose
keys alone cost the most.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx

from kvplugin.cache.codec.rows import ALLOWED_BITS, CHANNEL_KEYS, fitting_codec

__all__ = ["RAISED_SHARE", "SAMPLE_GROUPS", "key_spread", "ranked_bits", "layer_key_bits"]

#: One layer in this many (rounded up) is raised
RAISED_SHARE = 10
#: Groups of rows a layer's spread is measured on: enough to rank, a fraction of the codec
SAMPLE_GROUPS = 4


def _sampled(keys: mx.array, group: int, rope: Any, runs: Any) -> mx.array:
    """Up to :data:`SAMPLE_GROUPS` groups of ``group`` rows of ``keys``, evenly spaced past
    the first group (where the sinks are, which the codec keeps apart), pre-RoPE at each
    row's position where ``rope`` is given (``runs``: slot ranges and their positions)."""
    from kvplugin.cache.codec.prerope import turn

    n = keys.shape[-2]
    groups = n // group
    if groups < 2:
        return keys if rope is None else turn(keys, rope, runs, -1.0)
    picks = min(SAMPLE_GROUPS, groups - 1)
    starts = [group * (1 + j * (groups - 1) // picks) for j in range(picks)]
    parts = []
    for s in starts:
        part = keys[..., s : s + group, :]
        if rope is not None:  # the runs over [s, s + group), from row 0 of the part
            sub = tuple((max(a, s) - s, min(a + c, s + group) - max(a, s), p + max(a, s) - a)
                        for a, c, p in runs if a < s + group and a + c > s)
            part = turn(part, rope, sub, -1.0)
        parts.append(part)
    return mx.concatenate(parts, axis=-2)


def key_spread(coded: mx.array, group: int) -> float:
    """The variance of ``coded`` (``(..., n, D)``, keys as the codec takes them) over each
    group of ``group`` tokens, summed over channels, averaged over heads and groups. Why this
    tracks the codec's error: the sum is the same in the rotated basis the codec quantizes,
    where each channel is near-Gaussian, so its range over a group (the step, times the
    levels) goes with its standard deviation; and it needs no rotation (it ranked the layers
    as the ranges after the rotation do, docs/benchmarks.md)."""
    *lead, n, width = coded.shape
    rows = max(1, n // group)
    grouped = coded[..., : rows * group, :].astype(mx.float32).reshape(*lead, rows, -1, width)
    return mx.mean(mx.sum(mx.var(grouped, axis=-2), axis=-1)).item()


def ranked_bits(spreads: dict[int, float], bits: dict[int, int], sizes: dict[int, int],
                raised_bits: int) -> dict[int, int]:
    """Each layer's key bits: the ``ceil(len / RAISED_SHARE)`` layers of widest ``spreads``
    at ``raised_bits`` (where that is more than their ``bits``), then, from the narrowest
    up, one allowed width fewer until the extra bits (times each layer's ``sizes``, its key
    elements) are paid for; a layer is lowered only while that leaves the
    entry no larger than at ``bits``."""
    order = sorted(spreads, key=lambda i: (-spreads[i], i))
    out = dict(bits)
    owed = 0
    for i in order[: math.ceil(len(order) / RAISED_SHARE)]:
        if raised_bits > bits[i]:
            out[i] = raised_bits
            owed += (raised_bits - bits[i]) * sizes[i]
    for i in reversed(order):
        lower = [b for b in ALLOWED_BITS if b < bits[i]]
        if owed <= 0 or out[i] != bits[i] or not lower:
            continue
        out[i] = lower[-1]
        owed -= (bits[i] - lower[-1]) * sizes[i]
    if owed > 0:  # nothing left to pay with: as ``bits`` say
        return dict(bits)
    return out


def layer_key_bits(cache: list, raised_bits: int, codec: str,
                   base: Callable[[Any], tuple[int, int, int] | None],
                   ropes: list) -> dict[int, int]:
    """Key bits of each top-level K/V layer of ``cache`` that ``codec`` stores per channel
    (:func:`ranked_bits` over :func:`key_spread` of a sample of its rows), ``base(layer)``
    its (key bits, value bits, group) or None where it is not quantized; ``ropes`` the
    layers' key ropes (pre-RoPE keys) or None. Layers the codec does not store per channel,
    nested or recurrent ones keep their bits (absent)."""
    from mlx_lm.models.cache import RotatingKVCache

    from kvplugin.cache.codec.prerope import plain_runs, ring_runs
    from kvplugin.cache.codec.rotating import held_slots

    spreads, bits, sizes = {}, {}, {}
    for i, layer in enumerate(cache):
        got = base(layer) if isinstance(getattr(layer, "keys", None), mx.array) else None
        if got is None or fitting_codec(codec, layer.keys.shape[-1],
                                        layer.values.shape[-1]) not in CHANNEL_KEYS:
            continue
        if isinstance(layer, RotatingKVCache):  # the host's and kvplugin's bounded rings
            slots = held_slots(layer)
            runs = ring_runs(layer.offset, slots, layer.keep, min(layer._idx, slots))
        else:
            slots = layer.offset
            runs = plain_runs(slots)
        rope = ropes[i] if runs is not None else None
        spreads[i] = key_spread(_sampled(layer.keys[..., :slots, :], got[2], rope, runs),
                                got[2])
        bits[i] = got[0]
        sizes[i] = layer.keys[..., :slots, :].size
    return ranked_bits(spreads, bits, sizes, raised_bits) if spreads else {}
