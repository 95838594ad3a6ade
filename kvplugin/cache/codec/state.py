"""Recurrent state (``ArraysCache``: Mamba, GatedDeltaNet, Falcon-H1's SSM half) stored
quantized: each state array rotated along its last axis and quantized at 8 bits.

Why: a hybrid model's entry carries a fixed-size state for every recurrent layer, whatever
the prompt's length, and at full precision (often float32) it is most of a short entry: with
K/V quantized and the state not, an entry shrinks far less than its attention layers do. A
state array is a matrix per head whose rows mix many channels, so, as for keys, a seeded
Hadamard along the last axis (:mod:`kvplugin.cache.codec.rotation`) spreads a few large values
over a group before ``mx.quantize`` gives each group of the last axis a scale and a minimum.
An array whose last axis no group size divides (Mamba's ``d_state`` of 16) is quantized as
rows of 64 of its last two axes flattened, and only one that cannot be stays at full
precision (both recorded per array).

The stored layer subclasses ``ArraysCache`` so that the cold tiers carry it as they carry
recurrent state (its ``cache`` holds ``(codes, scales, minimums)`` tuples where it is
quantized; the record is scalar attributes); it is never handed to a model:
:func:`dequantize_state` gives back the very same class and arrays in their dtypes.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from kvplugin.cache.codec import rotation
from kvplugin.cache.layers import LayerKind, register_kind
from kvplugin.codecs import CODEC_ATTR, SEED_ATTR, UnknownCodec

__all__ = ["QuantizedArraysCache", "STATE_BITS", "STATE_CODEC", "has_state",
           "is_state_quantizable", "quantize_state", "dequantize_state", "state_record"]

STATE_BITS = 8
STATE_CODEC = "rotated-state"
_GROUPS = (64, 32)  # the first that divides an array's last axis
_GROUPS_ATTR = "kvplugin_state_groups"  # per array: its group, 0 = full precision or None
_ROTATED_ATTR = "kvplugin_state_rotated"  # per array: 1 = rotated along its last axis
_DTYPES_ATTR = "kvplugin_state_dtypes"
_WIDTHS_ATTR = "kvplugin_state_widths"  # per array: its last axis where regrouped, else 0
_CLS_ATTR = "kvplugin_state_cls"
_FIELDS = {"cache", "left_padding", "lengths"}


class QuantizedArraysCache(ArraysCache):
    """A stored recurrent layer: quantized state arrays and how to restore them. Not a cache
    a model can run (only ever in the store)."""

    def is_trimmable(self) -> bool:
        return False


register_kind(QuantizedArraysCache,
              LayerKind("QuantizedArraysCache", lambda layer: True, lambda layer: layer))


def has_state(cache: list) -> bool:
    """Whether an entry holds recurrent state (an ``ArraysCache`` layer, nested ones too)."""
    return any(isinstance(layer, ArraysCache) or has_state(list(getattr(layer, "caches", ())))
               for layer in cache)


def is_state_quantizable(layer: Any) -> bool:
    """An ``ArraysCache`` (or a subclass adding no attributes) holding float state arrays, at
    least one of which some group size divides."""
    if not isinstance(layer, ArraysCache) or isinstance(layer, QuantizedArraysCache):
        return False
    if set(vars(layer)) != _FIELDS or not isinstance(layer.cache, list):
        return False
    arrays = [a for a in layer.cache if a is not None]
    return bool(arrays) and all(isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating)
                                for a in arrays) and any(_group(a) for a in arrays)


def _group(a: mx.array) -> int:
    return next((g for g in _GROUPS if a.ndim and a.shape[-1] % g == 0), 0) or (
        _GROUPS[0] if _regroupable(a) else 0)


def _regroupable(a: mx.array) -> bool:
    """Its last two axes hold whole rows of 64 once flattened."""
    return a.ndim >= 2 and (a.shape[-2] * a.shape[-1]) % _GROUPS[0] == 0


def _rows(a: mx.array) -> tuple[mx.array, int]:
    """``a`` as rows its group divides, and the last axis it had where regrouped (else 0)."""
    if any(a.shape[-1] % g == 0 for g in _GROUPS):
        return a, 0
    return a.reshape(*a.shape[:-2], -1, _GROUPS[0]), a.shape[-1]


def quantize_state(layer: ArraysCache, bits: int = STATE_BITS) -> QuantizedArraysCache:
    q = QuantizedArraysCache.__new__(QuantizedArraysCache)
    q.left_padding, q.lengths = layer.left_padding, layer.lengths
    parts, groups, rotated, dtypes, widths = [], [], [], [], []
    for a in layer.cache:
        group = _group(a) if a is not None else 0
        x, width = _rows(a) if group else (a, 0)
        turn = bool(group) and rotation.rotatable(x.shape[-1])
        if group:
            x = rotation.rotate(x) if turn else x
            parts.append(tuple(mx.quantize(x, group_size=group, bits=bits)))
        else:
            parts.append(a)
        widths.append(str(width))
        groups.append(str(group))
        rotated.append("1" if turn else "0")
        dtypes.append("" if a is None else str(a.dtype).rsplit(".", 1)[-1])
    q.cache = parts
    q.bits = bits
    setattr(q, CODEC_ATTR, STATE_CODEC)
    setattr(q, SEED_ATTR, rotation.CODEC_SEED)
    setattr(q, _GROUPS_ATTR, ",".join(groups))
    setattr(q, _ROTATED_ATTR, ",".join(rotated))
    setattr(q, _DTYPES_ATTR, ",".join(dtypes))
    setattr(q, _WIDTHS_ATTR, ",".join(widths))
    setattr(q, _CLS_ATTR, f"{type(layer).__module__}:{type(layer).__qualname__}")
    return q


def _fields(q: QuantizedArraysCache) -> list[tuple[Any, int, bool, Any, int]]:
    """``(part, group, rotated, dtype, width)`` per state array, the record checked."""
    texts = [getattr(q, a, None) for a in (_GROUPS_ATTR, _ROTATED_ATTR, _DTYPES_ATTR,
                                            _WIDTHS_ATTR)]
    if not all(isinstance(t, str) for t in texts) or not isinstance(q.cache, list):
        raise UnknownCodec("stored state without a consistent record")
    groups, turns, dtypes, widths = (t.split(",") for t in texts)
    if not len(groups) == len(turns) == len(dtypes) == len(widths) == len(q.cache):
        raise UnknownCodec("stored state whose record does not match its arrays")
    out = []
    for part, g, r, d, w in zip(q.cache, groups, turns, dtypes, widths):
        dtype = getattr(mx, d, None) if d else None
        if g not in ("0", "32", "64") or r not in ("0", "1") or not w.isdigit() or (
                d and not isinstance(dtype, mx.Dtype)):
            raise UnknownCodec(f"stored state array with record {g!r}/{r!r}/{d!r}/{w!r}")
        group = int(g)
        if group:
            if not (isinstance(part, (tuple, list)) and len(part) == 3
                    and all(isinstance(p, mx.array) for p in part)):
                raise UnknownCodec("stored state array without its codes, scales, minimums")
            width = part[0].shape[-1] * 32 // q.bits
            rows = part[0].shape[-2] if part[0].ndim >= 2 else 0
            if (width % group or part[1].shape[-1] * group != width
                    or (r == "1" and not rotation.rotatable(width))
                    or (int(w) and (rows * width) % int(w))):
                raise UnknownCodec("stored state array whose widths do not match its record")
        elif part is not None and not isinstance(part, mx.array):
            raise UnknownCodec("stored state array that is neither kept nor quantized")
        out.append((part, group, r == "1", dtype, int(w)))
    return out


def state_record(q: QuantizedArraysCache) -> None:
    """:class:`UnknownCodec` for a stored state this version cannot read: a miss."""
    if getattr(q, CODEC_ATTR, None) != STATE_CODEC or getattr(q, "bits", None) != STATE_BITS:
        raise UnknownCodec(f"stored state with codec {getattr(q, CODEC_ATTR, None)!r}")
    if type(getattr(q, SEED_ATTR, None)) is not int:
        raise UnknownCodec("stored state without an integer seed")
    _fields(q)


def _resolve(spec: Any) -> type:
    module, _, name = str(spec).partition(":")
    cls = getattr(sys.modules.get(module), name, None)
    ok = (isinstance(cls, type) and issubclass(cls, ArraysCache)
          and not issubclass(cls, QuantizedArraysCache))
    return cls if ok else ArraysCache


def dequantize_state(q: QuantizedArraysCache) -> ArraysCache:
    """The same recurrent layer back, its arrays in their dtypes (left unevaluated)."""
    state_record(q)
    seed = getattr(q, SEED_ATTR)
    arrays = []
    for part, group, turned, dtype, width in _fields(q):
        if not group:
            arrays.append(part)
            continue
        x = mx.dequantize(*part, group_size=group, bits=q.bits)
        x = rotation.unrotate(x, seed) if turned else x
        if width:  # regrouped: back to its own last two axes
            x = x.reshape(*x.shape[:-2], -1, width)
        arrays.append(x.astype(dtype))
    cls = _resolve(getattr(q, _CLS_ATTR, ""))
    layer = cls.__new__(cls)
    ArraysCache.__init__(layer, len(arrays))
    layer.cache = arrays
    layer.left_padding, layer.lengths = q.left_padding, q.lengths
    return layer
