"""Restoring a quantized layer when MLX runs on the CPU: rotated codecs in numpy, ``affine``
with MLX ops that keep no code-sized temporaries (:func:`dequantize`).

Why: a hit on a quantized entry is restored before its prefill, so the restore is part of the
warm turn's time to first token. On MLX's CPU backend each step of it (unpack the codes,
scale them, rotate them back) is a separate MLX kernel, and those are slow there, while
numpy's bundled OpenBLAS does the rotation as one GEMM (docs/benchmarks.md, "The restore on
the CPU"). On a GPU MLX's kernels stay in charge (:mod:`kvplugin.cache.codec.quantize`):
there the whole restore is a few Metal kernels.

Same arithmetic as the MLX path (fp32 ``codes * scale + minimum``, the rotation's transpose),
so a layer restores to within float rounding of it (a test holds them within two ulps).
Codes of every width are one little-endian bit stream (``mx.quantize``'s packing and
:func:`kvplugin.cache.codec.channel.pack_codes` alike). ``affine`` keeps the MLX path.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["dequantize", "restores_here", "restore_layer"]

#: Code widths whose codes fill whole bytes: read as bytes, no code straddles two
BYTE_FILLING_BITS = (2, 4, 8)
#: Widths whose codes straddle bytes: 8 codes in every ``bits`` bytes of the stream
STREAM_BITS = (3, 5, 6)


def restores_here(codec: str, key_bits: int, value_bits: int) -> bool:
    """This path takes the layer: MLX on the CPU, a rotated codec.

    ``affine`` (the 8-bit default) stays with MLX: its restore is one fused
    ``mx.dequantize`` kernel, and the copy into MLX and fresh pages cost what numpy's faster
    passes would save. The gain is the rotation."""
    return (mx.default_device() == mx.cpu and codec != "affine"
            and all(b in BYTE_FILLING_BITS + STREAM_BITS for b in (key_bits, value_bits)))


def dequantize(words: mx.array, scales: mx.array, biases: mx.array, group_size: int,
               bits: int) -> mx.array:
    """``mx.dequantize`` (bit for bit the same values, in ``scales``' dtype) without its
    transient on the CPU.

    Why: on MLX's CPU backend ``mx.dequantize`` is a chain of ops that first widens every code
    to a uint32, so restoring a layer held 5x its fp16 output (2x fp32) at the peak. On the
    demo's 2-layer fp16 model that was 4.4x the whole entry, and the real server's MLX peak
    on reuse went above stock's (6.3 against 4.5 MiB above the start of the conversation).
    Here the codes are read as bytes (a view: nothing copied) and scaled in the output dtype:
    the peak is 1x the output at 8 bits and 2x at 4 and 2, and it is faster (a KV-heavy fp32
    layer's keys at 8 bits: 0.43 -> 0.20 ms). A GPU keeps the one fused kernel, and 3-, 5-
    and 6-bit codes, which straddle bytes, keep ``mx.dequantize``.
    """
    if mx.default_device() != mx.cpu or bits not in BYTE_FILLING_BITS:
        return mx.dequantize(words, scales, biases, group_size=group_size, bits=bits)
    octets = mx.view(words, mx.uint8)  # little-endian: code j at bit j * bits of its word
    per = 8 // bits
    if per == 1:
        codes = octets
    else:
        mask = (1 << bits) - 1
        codes = mx.stack([(octets >> (i * bits)) & mask for i in range(per)], axis=-1)
        codes = codes.reshape(*octets.shape[:-1], -1)
    *lead, width = codes.shape
    grouped = codes.reshape(*lead, width // group_size, group_size).astype(scales.dtype)
    return (grouped * scales[..., None] + biases[..., None]).reshape(*lead, width)


def _f32(x: mx.array) -> np.ndarray:
    """An MLX array as fp32 numpy (numpy has no bfloat16, so narrower dtypes go via MLX)."""
    return np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))


def _codes(words: mx.array, n: int, bits: int) -> np.ndarray:
    """``(..., n', W)`` uint32 words (``pack_codes``' / ``mx.quantize``'s layout: code ``j``
    at bit ``j * bits``, little-endian) -> the first ``n`` rows' codes as ``(..., n, W*32/bits)``
    uint8."""
    octets = np.ascontiguousarray(np.asarray(words)[..., :n, :]).view(np.uint8)
    if 8 % bits:
        return _stream_codes(octets, bits)
    per = 8 // bits
    if per == 1:
        return octets
    codes = np.empty(octets.shape[:-1] + (octets.shape[-1] * per,), np.uint8)
    mask = (1 << bits) - 1
    for i in range(per):
        np.bitwise_and(np.right_shift(octets, i * bits), mask, out=codes[..., i::per])
    return codes


def _stream_codes(octets: np.ndarray, bits: int) -> np.ndarray:
    """Codes of a little-endian bit stream whose codes straddle bytes: every ``bits`` bytes
    hold 8 codes, read as one 64-bit word."""
    *lead, nbytes = octets.shape
    chunks = octets.reshape(*lead, nbytes // bits, bits)
    word = np.zeros(chunks.shape[:-1], np.uint64)
    for i in range(bits):
        word |= chunks[..., i].astype(np.uint64) << np.uint64(8 * i)
    codes = np.empty((*chunks.shape[:-1], 8), np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for j in range(8):
        codes[..., j] = (word >> np.uint64(j * bits)) & mask
    return codes.reshape(*lead, nbytes * 8 // bits)


def _per_token(parts: Any, n: int, group: int, bits: int) -> np.ndarray:
    """``mx.quantize``'s affine layout: a scale and a minimum per ``group`` values of a row."""
    codes = _codes(parts[0], n, bits)
    *lead, width = codes.shape
    out = codes.astype(np.float32).reshape(*lead, width // group, group)
    out *= _f32(parts[1])[..., :n, :, None]
    out += _f32(parts[2])[..., :n, :, None]
    return out.reshape(*lead, width)


def _per_channel(parts: Any, n: int, group: int, bits: int) -> np.ndarray:
    """Keys per channel (:mod:`kvplugin.cache.codec.channel`): a scale and a minimum per channel of
    every ``group`` tokens."""
    codes = _codes(parts[0], n, bits)
    *lead, _, width = codes.shape
    rows = -(-n // group)
    out = np.empty((*lead, rows * group, width), np.float32)
    out[..., :n, :] = codes
    out[..., n:, :] = 0  # the last group's padding: scaled with it, then dropped
    grouped = out.reshape(*lead, rows, group, width)
    grouped *= _f32(parts[1])[..., :rows, None, :]
    grouped += _f32(parts[2])[..., :rows, None, :]
    return out[..., :n, :]


def _symmetric(parts: Any, n: int, group: int, bits: int) -> np.ndarray:
    """Scale-only values (:mod:`kvplugin.cache.codec.symmetric`): ``(code - half) * scale``."""
    codes = _codes(parts[0], n, bits)
    *lead, width = codes.shape
    out = codes.astype(np.float32).reshape(*lead, width // group, group)
    out -= ((1 << bits) - 1) / 2
    out *= _f32(parts[1])[..., :n, :, None]
    return out.reshape(*lead, width)


@lru_cache(maxsize=1)
def _numpy_blas() -> Any:
    """numpy's own BLAS (the OpenBLAS numpy 2 wheels bundle; not the one MLX links), for
    :mod:`threadpoolctl` to hold. Where numpy uses another BLAS nothing is selected and the
    limit does nothing."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(prefix="libscipy_openblas")


@lru_cache(maxsize=16)
def _unrotation(width: int, seed: int) -> np.ndarray:
    from kvplugin.cache.codec.rotation import _matrix

    return np.ascontiguousarray(_matrix(width, seed).T)  # x @ R.T undoes x @ R


def restore_layer(layer: Any, codec: str, seed: int, n: int, vbits: int, kept: list,
                  dtype: Any, rope: Any = None, runs: Any = None, gaps_to: int | None = None
                  ) -> tuple[mx.array, mx.array]:
    """The first ``n`` keys and values of a layer quantized with a rotated ``codec``, in
    ``dtype``.

    ``kept`` are the layer's full-precision rows for keys and values (or ``None``), written
    back by the MLX path's own ``_restore_protected`` (it only slices, so it takes numpy
    arrays as well). numpy's BLAS runs the rotation on one thread: on every core its idle
    workers spin after each GEMM and slow the host's next MLX matmuls. ``rope`` at ``runs``:
    the keys' rope put back (:func:`kvplugin.cache.codec.prerope.turn_numpy`); ``gaps_to``: the
    ``n`` rows spread to that many first, gaps where the protected rows go
    (:func:`kvplugin.cache.codec.protected.open_gaps`).
    """
    from kvplugin.cache.codec.protected import open_gaps, protected_ranges
    from kvplugin.cache.codec.protected import restore_protected as _restore_protected
    from kvplugin.codecs import CHANNEL_KEYS, SYM

    restore_keys = _per_channel if codec in CHANNEL_KEYS else _per_token
    restore_values = _symmetric if codec == SYM else _per_token
    out = []
    with _numpy_blas().limit(limits=1):
        for restore, parts, rows, bits, turned in (
                (restore_keys, layer.keys, kept[0], layer.bits, rope),
                (restore_values, layer.values, kept[1], vbits, None)):
            x = restore(parts, n, layer.group_size, bits)  # still rotated
            x = x @ _unrotation(x.shape[-1], seed)  # one GEMM per head, no copy of the view
            if gaps_to is not None:
                x = open_gaps(x, protected_ranges(layer), gaps_to)
            if turned is not None:
                from kvplugin.cache.codec.prerope import turn_numpy

                x = turn_numpy(x, turned, runs)
            x = _restore_protected(x, None if rows is None else _f32(rows), layer,
                                   n if gaps_to is None else gaps_to)
            out.append(mx.array(x.astype(np.float16) if dtype == mx.float16 else x))
    return tuple(x if x.dtype == dtype else x.astype(dtype) for x in out)  # bfloat16
