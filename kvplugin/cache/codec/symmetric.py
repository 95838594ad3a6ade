"""Values quantized per token with a scale and no minimum, for the ``rotated-channel-sym``
codec of :mod:`kvplugin.cache.codec.quantize`.

Why no minimum: after the Hadamard rotation a real model's values are centred on zero in
every group (the rotation mixes each channel into all of them), so the minimum ``mx.quantize``
stores beside every scale buys nothing, while dropping it is what brings a 3-bit entry with
its protected rows into its size class (docs/benchmarks.md). Keys keep theirs (per-channel
offsets are real).

Layout, token-major like ``mx.quantize``'s so that trims and prefix copies cut it unchanged:
codes ``(..., n, D * bits / 32)`` uint32 (:func:`kvplugin.cache.codec.channel.pack_codes`), scales
``(..., n, D / group)`` in the values' dtype. Code ``c`` of ``2**bits`` levels stands for
``(c - (2**bits - 1) / 2) * scale``: symmetric around zero, every level used.
"""

from __future__ import annotations

import mlx.core as mx

from kvplugin.cache.codec.channel import pack_codes, unpack_codes

__all__ = ["quantize_symmetric", "dequantize_symmetric"]


def _grouped(x: mx.array, group: int) -> mx.array:
    *lead, width = x.shape
    return x.astype(mx.float32).reshape(*lead, width // group, group)


def quantize_symmetric(x: mx.array, group: int, bits: int) -> tuple[mx.array, mx.array]:
    """``x`` ``(..., n, D)`` -> ``(codes, scales)``; ``D`` a multiple of 32 and of ``group``."""
    half = ((1 << bits) - 1) / 2
    grouped = _grouped(x, group)
    # Stored in x's dtype: codes are computed from the stored (rounded) scale.
    scales = (mx.abs(grouped).max(axis=-1) / half).astype(x.dtype)
    step = scales.astype(mx.float32)[..., None]
    codes = mx.clip(mx.round(grouped / mx.where(step > 0, step, 1.0) + half), 0, 2 * half)
    return pack_codes(codes.reshape(x.shape), bits), scales


def dequantize_symmetric(parts, n: int, group: int, bits: int, dtype) -> mx.array:
    """The first ``n`` tokens of ``(codes, scales)`` back to ``(..., n, D)``."""
    words, scales = parts[0][..., :n, :], parts[1][..., :n, :]
    half = ((1 << bits) - 1) / 2
    codes = _grouped(unpack_codes(words, bits), group)
    out = (codes - half) * scales.astype(mx.float32)[..., None]
    return out.reshape(*out.shape[:-2], -1).astype(dtype)
