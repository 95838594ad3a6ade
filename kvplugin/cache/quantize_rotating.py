"""Rotating (sliding-window, ``--max-kv-size``) layers stored quantized.

Why: mlx-lm's ``QuantizedKVCache`` only describes a linear cache (slots ``[0, offset)``), so
rotating layers used to be stored at full precision: with ``--max-kv-size`` and
``--kv-cache-quantization`` the start-up line said "4-bit entries" and none was quantized,
and the sliding-window layers of Gemma 3 or gpt-oss never were. A rotating layer's slots are
quantized here as they are (whatever their ring order), with what is needed to give back
the very same class, slots, ``_idx``, ``offset``, ``keep`` and ``max_size`` on reuse.

With a rotated codec the slots are rotated along head_dim first (``rotated``: the seeded
Hadamard of :mod:`kvplugin.cache.rotation`, then per-token groups), which spreads a few large
channels over all of them as it does for linear layers. Per-channel key groups and protected
tokens are not applied to a ring: its slots are not in token order, and a sliding window
holds no attention sinks (``keep`` tokens aside).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from kvplugin.cache import rotation
from kvplugin.cache.cpu_restore import dequantize
from kvplugin.cache.layers import LayerKind, register_kind
from kvplugin.codecs import CODEC_ATTR, SEED_ATTR, UnknownCodec

__all__ = ["QuantizedRotatingKVCache", "quantize_rotating", "dequantize_rotating",
           "is_rotating_quantizable"]


class QuantizedRotatingKVCache:
    """A stored rotating layer: packed slots + scales/biases, and how to restore it.

    Not a cache the host can run (it is only ever in the store): ``offset`` is the tokens the
    layer has seen, ``keys[0].shape[-2]`` the slots it holds.
    """

    def __init__(self) -> None:
        self.keys: tuple | None = None
        self.values: tuple | None = None
        self.offset = 0
        self.max_size = 0
        self.keep = 0
        self._idx = 0
        self.bits = 8
        self.group_size = 64
        self.dtype_name = "float16"
        self.cls = "mlx_lm.models.cache:RotatingKVCache"
        self.step: int | None = None
        setattr(self, CODEC_ATTR, "affine")  # what older records, without it, were
        setattr(self, SEED_ATTR, 0)

    def is_trimmable(self) -> bool:  # a wrapped ring cannot lose its last tokens
        return False

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for part in (self.keys or ()) + (self.values or ()) for a in [part])


register_kind(QuantizedRotatingKVCache,
              LayerKind("QuantizedRotatingKVCache", lambda layer: True, lambda layer: layer))


def is_rotating_quantizable(layer: Any, group_size: int) -> bool:
    return (
        isinstance(layer, RotatingKVCache)
        and layer.keys is not None
        and layer.offset > 0
        and layer.keys.shape[-1] % group_size == 0
        and layer.values.shape[-1] % group_size == 0
    )


def quantize_rotating(layer: RotatingKVCache, bits: int, group_size: int,
                      codec: str = "affine") -> QuantizedRotatingKVCache:
    """``codec`` other than ``affine`` stores the slots ``rotated`` (power-of-two widths;
    otherwise ``affine``, recorded as such)."""
    q = QuantizedRotatingKVCache()
    keys, values = layer.keys, layer.values
    if codec != "affine" and all(rotation.rotatable(a.shape[-1]) for a in (keys, values)):
        keys, values = rotation.rotate(keys), rotation.rotate(values)
        setattr(q, CODEC_ATTR, "rotated")
        setattr(q, SEED_ATTR, rotation.CODEC_SEED)
    q.keys = tuple(mx.quantize(keys, group_size=group_size, bits=bits))
    q.values = tuple(mx.quantize(values, group_size=group_size, bits=bits))
    q.offset, q.max_size, q.keep, q._idx = layer.offset, layer.max_size, layer.keep, layer._idx
    q.bits, q.group_size = bits, group_size
    q.dtype_name = str(layer.keys.dtype).rsplit(".", 1)[-1]
    q.cls = f"{type(layer).__module__}:{type(layer).__qualname__}"
    q.step = vars(layer).get("step")
    return q


def _resolve(spec: str) -> type:
    """The recorded rotating class if its module is already imported (the spec may come from
    a cold-tier file: nothing is imported from data), else ``RotatingKVCache``."""
    module, _, name = str(spec).partition(":")
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) and issubclass(cls, RotatingKVCache) else RotatingKVCache


def rotating_codec(q: QuantizedRotatingKVCache) -> str:
    """The stored layer's codec; :class:`UnknownCodec` for one this version cannot read (a
    record from a newer kvplugin, or a damaged one): a miss, never misread."""
    codec, seed = getattr(q, CODEC_ATTR, "affine"), getattr(q, SEED_ATTR, 0)
    if codec not in ("affine", "rotated"):
        raise UnknownCodec(f"stored rotating layer has unknown codec {codec!r}")
    if codec == "rotated" and (type(seed) is not int
                               or not all(rotation.rotatable(p.shape[-1] * 32 // q.bits)
                                          for p in (q.keys[0], q.values[0]))):
        raise UnknownCodec("rotated window layer without an integer seed or power-of-two width")
    return codec


def dequantize_rotating(q: QuantizedRotatingKVCache) -> RotatingKVCache:
    """The same rotating layer back, full precision, evaluated."""
    codec = rotating_codec(q)
    cls = _resolve(q.cls)
    layer = cls.__new__(cls)
    RotatingKVCache.__init__(layer, q.max_size, q.keep)
    dtype = getattr(mx, q.dtype_name, mx.float16)
    keys = dequantize(*q.keys, q.group_size, q.bits)
    values = dequantize(*q.values, q.group_size, q.bits)
    if codec == "rotated":
        seed = getattr(q, SEED_ATTR)
        keys, values = rotation.unrotate(keys, seed), rotation.unrotate(values, seed)
    keys, values = keys.astype(dtype), values.astype(dtype)
    mx.eval(keys, values)
    layer.keys, layer.values = keys, values
    layer.offset, layer._idx = q.offset, q._idx
    if q.step is not None:
        layer.step = q.step
    return layer
