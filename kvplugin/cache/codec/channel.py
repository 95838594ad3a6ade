"""Keys quantized per channel (KIVI): each channel of each group of ``G`` tokens gets its own
scale and minimum, for the ``rotated-channel`` codec of :mod:`kvplugin.cache.codec.quantize`.

Why per channel: a real model's keys differ far more *between* channels (each has its own
offset and range, a few carry outliers) than between tokens within a channel, so a scale per
channel spends the bits where keys vary (docs/benchmarks.md). Values stay per token
(their error averages out in the attention sum).

Layout, chosen so that everything that cuts entries along the token axis keeps working
unchanged (trim, prefix copies, cold-tier files): the packed codes are **token-major**, one
row of ``D * bits / 32`` ``uint32`` words per token like ``mx.quantize``'s, and the scales and
minimums are one row per *group* of ``G`` tokens (``ceil(n / G)`` rows, never more rows than
tokens). Cutting every array to its first ``m`` rows therefore keeps what the first ``m``
tokens need. The packing is our own (little-endian bit stream per 32 values), written with
MLX ops, because ``mx.quantize`` can only group along the last axis.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["quantize_channels", "dequantize_channels", "scale_rows", "pack_codes", "unpack_codes"]


def scale_rows(tokens: int, group: int) -> int:
    """Rows of scales (and minimums) ``tokens`` tokens need in groups of ``group``."""
    return -(-tokens // group)


def _per_token(rows: mx.array, group: int, n: int) -> mx.array:
    """One row per group of tokens -> one row per token (float32), for the first ``n``."""
    return mx.repeat(rows.astype(mx.float32), group, axis=-2)[..., :n, :]


def _shifts(bits: int) -> mx.array:
    return mx.array([bits * i for i in range(32 // bits)], dtype=mx.uint32)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """``(..., D)`` integer codes below ``2**bits`` -> ``(..., D * bits / 32)`` uint32 words:
    every 32 codes fill ``bits`` words, code ``j`` at bit ``j * bits`` of the stream (for 2, 4
    and 8 bits the same layout as ``mx.quantize``'s; a test holds it to that).

    2, 4 and 8 bits are packed into bytes and the bytes read as words (little-endian, as MLX's
    own layout assumes): the temporaries are byte-sized, where widening every code to a uint32
    first held 2x an fp16 layer at the peak."""
    *lead, width = codes.shape
    if 8 % bits == 0:
        per = 8 // bits
        c = codes.astype(mx.uint8).reshape(*lead, width // per, per)
        octets = c[..., 0]
        for i in range(1, per):
            octets = octets | (c[..., i] << (i * bits))
        return mx.view(octets, mx.uint32)
    c = codes.astype(mx.uint32).reshape(*lead, width // 32, 32)
    words: list[mx.array | None] = [None] * bits
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        part = c[..., j] << shift
        words[word] = part if words[word] is None else words[word] | part
        if shift + bits > 32:  # the code's high bits start the next word
            high = c[..., j] >> (32 - shift)
            words[word + 1] = high if words[word + 1] is None else words[word + 1] | high
    return mx.stack(words, axis=-1).reshape(*lead, width * bits // 32)


def unpack_codes(words: mx.array, bits: int) -> mx.array:
    """Inverse of :func:`pack_codes`: ``(..., W)`` uint32 -> ``(..., W * 32 / bits)`` uint32."""
    *lead, width = words.shape
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    if 32 % bits == 0:
        return ((words[..., None] >> _shifts(bits)) & mask).reshape(*lead, width * 32 // bits)
    w = words.reshape(*lead, width // bits, bits)
    codes = []
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        code = w[..., word] >> shift
        if shift + bits > 32:
            code = code | (w[..., word + 1] << (32 - shift))
        codes.append(code & mask)
    return mx.stack(codes, axis=-1).reshape(*lead, width * 32 // bits)


def quantize_channels(x: mx.array, group: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """``x`` ``(..., n, D)`` -> ``(codes, scales, minimums)``: codes ``(..., n, D*bits/32)``
    uint32, scales and minimums ``(..., ceil(n/group), D)`` in ``x``'s dtype. ``D`` must be a
    multiple of 32. The last group may be short: it is padded with its last token, which
    changes neither its minimum nor its maximum.

    Each group's scale and minimum broadcast over its tokens rather than being repeated into
    token-sized arrays, and the codes are narrowed to bytes before packing: the peak is ~4x
    the layer in fp16 (it was 12x, which on a 2-layer model put a real server's MLX peak at
    twice stock's while it stored the first entry)."""
    *lead, n, width = x.shape
    rows = scale_rows(n, group)
    padded = x if rows * group == n else mx.concatenate(
        [x, mx.repeat(x[..., -1:, :], rows * group - n, axis=-2)], axis=-2)
    grouped = padded.reshape(*lead, rows, group, width)
    # min and max are exact in any float dtype: widened after, on a row per group
    low = grouped.min(axis=-2).astype(mx.float32)
    high = grouped.max(axis=-2).astype(mx.float32)
    levels = (1 << bits) - 1
    # Stored in x's dtype: codes are computed from the stored (rounded) scale and minimum.
    scales = ((high - low) / levels).astype(x.dtype)
    mins = low.astype(x.dtype)
    step = scales.astype(mx.float32)[..., None, :]
    base = mins.astype(mx.float32)[..., None, :]
    codes = mx.round((grouped.astype(mx.float32) - base) / mx.where(step > 0, step, 1.0))
    codes = mx.clip(codes, 0, levels).astype(mx.uint8)  # bits <= 8
    codes = codes.reshape(*lead, rows * group, width)[..., :n, :]
    return pack_codes(codes, bits), scales, mins


def dequantize_channels(parts, n: int, group: int, bits: int, dtype) -> mx.array:
    """The first ``n`` tokens of ``(codes, scales, minimums)`` back to ``(..., n, D)``."""
    words, scales, mins = parts[0][..., :n, :], parts[1], parts[2]
    rows = scale_rows(n, group)
    codes = unpack_codes(words, bits).astype(mx.float32)
    step = _per_token(scales[..., :rows, :], group, n)
    base = _per_token(mins[..., :rows, :], group, n)
    return (codes * step + base).astype(dtype)
