"""Pre-RoPE keys: a layer's RoPE taken out of its keys before per-channel quantization and
put back after the restore, at each row's (a ring: each slot's) token position.

Why: after RoPE a channel pair swings with the position, so a per-channel group's range
spans that swing rather than the channel's own spread; without it the range is the
channel's (KVQuant; docs/benchmarks.md, "Pre-RoPE keys"). The rope is the
model's own (:mod:`kvplugin.cache.model.rope`), recorded on the stored layer
(:data:`KEY_ROPE_ATTR`), and a restore without the same rope is a miss, never misread.

Positions come as runs ``(first slot, slots, first position)``: a plain layer's rows are
one run from position 0; a ring's slots are at most three (its ``keep`` head, the slots up
to its newest, the older ones after them). The restore on the CPU turns the keys in numpy
(:func:`turn_numpy`, tables cached per rope and runs), elsewhere ``mx.fast.rope``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvplugin.cache.model.rope import KeyRope, parse_record
from kvplugin.codecs import CHANNEL_KEYS, UnknownCodec

__all__ = ["KEY_ROPE_ATTR", "Runs", "has_window", "plain_runs", "ring_runs", "turn", "turn_numpy",
           "window_ropes", "recorded_rope", "check_rope"]

#: What a layer stored with pre-RoPE keys records its rope under (:attr:`KeyRope.record`)
KEY_ROPE_ATTR = "kvplugin_key_rope"

Runs = tuple[tuple[int, int, int], ...]


def plain_runs(n: int) -> Runs:
    return ((0, n, 0),)


def ring_runs(offset: int, slots: int, keep: int, idx: int) -> Runs | None:
    """The positions of a ring's ``slots`` held slots; None where its state does not say
    them (then its keys are stored post-RoPE). The newest token is in slot ``idx - 1``;
    older ones go back through ``[keep, slots)``, wrapping past its end."""
    if offset <= slots:
        return plain_runs(slots) if offset == slots else None
    if not 0 <= keep <= idx <= slots or keep == slots:
        return None
    runs = ((0, keep, 0), (keep, idx - keep, offset - idx + keep),
            (idx, slots - idx, offset - slots + keep))
    return tuple(r for r in runs if r[1] > 0)


def turn(keys: mx.array, rope: KeyRope, runs: Runs, sign: float) -> mx.array:
    """``keys`` (``(..., slots, D)``) rotated by ``sign`` x the rope's angle at each slot's
    position (``sign`` -1 undoes the model's rope exactly: ``mx.fast.rope`` with its scale
    negated); computed in float32, returned in ``keys``' dtype."""
    wide = keys.astype(mx.float32)
    parts = [mx.fast.rope(wide[..., a : a + c, :], rope.dims, traditional=rope.traditional,
                          base=rope.base, scale=sign * rope.scale, offset=p)
             for a, c, p in runs]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)
    return out.astype(keys.dtype)


@lru_cache(maxsize=4)  # an entry's distinct ropes and layouts; each table is held till then
def _tables(rope: KeyRope, runs: Runs) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, dims)`` float32 factors of each slot's angle, laid out as the rope pairs
    channels: the turned keys are ``x * cos + partner(x) * signed sin``. The cosines and
    sines are ``mx.fast.rope``'s own (of a unit vector per pair), so the keys come back
    with the very angles the model turned them by, float32 rounding included."""
    slots, half = sum(c for _, c, _ in runs), rope.dims // 2
    ones, zeros = mx.ones((slots, half, 1)), mx.zeros((slots, half, 1))
    if rope.traditional:  # pairs (0, 1), (2, 3), ...
        unit = mx.concatenate([ones, zeros], axis=-1).reshape(slots, rope.dims)
    else:  # pairs (i, i + dims / 2)
        unit = mx.concatenate([ones[..., 0], zeros[..., 0]], axis=-1)
    out = np.asarray(turn(unit[None], rope, tuple((sum(c for _, c, _ in runs[:i]), c, p)
                                                  for i, (_, c, p) in enumerate(runs)), 1.0)[0])
    cos, sin = (out[:, 0::2], out[:, 1::2]) if rope.traditional else (out[:, :half],
                                                                      out[:, half:])
    if rope.traditional:
        both = np.stack([cos, cos], axis=-1).reshape(slots, rope.dims)
        signed = np.stack([-sin, sin], axis=-1).reshape(slots, rope.dims)
    else:
        both, signed = np.concatenate([cos, cos], -1), np.concatenate([-sin, sin], -1)
    return np.ascontiguousarray(both), np.ascontiguousarray(signed)


def turn_numpy(x: np.ndarray, rope: KeyRope, runs: Runs) -> np.ndarray:
    """The model's rope applied to float32 ``x`` (``(..., slots, D)``, in place): whole-width
    passes, a pair's partner gathered once: fewer, faster passes than turning each half."""
    both, signed = _tables(rope, runs)
    d = rope.dims
    turned = x[..., :d]
    if rope.traditional:
        partner = turned.reshape(*turned.shape[:-1], d // 2, 2)[..., ::-1].reshape(turned.shape)
    else:
        partner = np.concatenate([turned[..., d // 2 :], turned[..., : d // 2]], axis=-1)
    turned *= both
    partner *= signed
    turned += partner
    return x


def window_ropes(cache: list, key_ropes: Any) -> tuple | None:
    """``key_ropes`` for an entry with a rotating layer (sliding windows, ``--max-kv-size``),
    every layer of it; None for an entry of plain layers only. Why the line is there: on a
    windowed model pre-RoPE keys on its global layers too measured best, while an all-plain
    model's real chat left stock's answers at near ties with them (docs/benchmarks.md,
    "Pre-RoPE keys")."""
    if key_ropes is None or len(key_ropes) != len(cache) or not has_window(cache):
        return None
    return tuple(key_ropes) if any(key_ropes) else None


def has_window(cache: list) -> bool:
    """Whether an entry has a rotating layer (a sliding window, ``--max-kv-size``)."""
    from mlx_lm.models.cache import RotatingKVCache

    return any(isinstance(layer, RotatingKVCache) for layer in cache)


def recorded_rope(layer: Any, codec: str) -> KeyRope | None:
    """The rope a stored layer's keys were taken out of, None for post-RoPE keys;
    :class:`UnknownCodec` for a record this version cannot read."""
    text = getattr(layer, KEY_ROPE_ATTR, None)
    if text is None:
        return None
    rope = parse_record(text)
    if rope is None or codec not in CHANNEL_KEYS:
        raise UnknownCodec(f"stored layer with an unknown key rope record {text!r}")
    return rope


def check_rope(layer: Any, codec: str, known: KeyRope | None) -> KeyRope | None:
    """:func:`recorded_rope`, and :class:`UnknownCodec` unless ``known`` (the serving model's
    rope of this layer) is the very same: pre-RoPE keys restored without their rope would be
    wrong, so such an entry is a miss."""
    rope = recorded_rope(layer, codec)
    if rope is not None and rope != known:
        raise UnknownCodec("stored layer with pre-RoPE keys, and the serving model's rope of "
                           f"that layer is {known.record if known else 'unknown'}")
    return rope
