"""A block of K/V rows through a codec and back, for plain and rotating layers alike.

Why a module of its own: a plain layer's rows are its tokens in order, a rotating layer's are
its ring's slots, yet both store the same arrays (codes, scales, minimums, and the protected
rows as a last array) with the same record on the stored layer. Encoding, the record's
checks and the restore are written once, here; :mod:`kvplugin.cache.codec.quantize` and
:mod:`kvplugin.cache.codec.rotating` decide which rows a layer has and which to protect.

The record (scalar attributes, which the SSD and remote formats carry): the codec, seed and
value bits of :mod:`kvplugin.codecs`; the protected rows as ``(start, count)`` ranges in the
order the last array holds them: the first ``SINK_ATTR`` rows, the ``BOUNDARY_ATTR`` ranges
(``"start:count,..."``, ascending and disjoint), then ``RECENT_ATTR`` rows from
``RECENT_START_ATTR`` on.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvplugin.cache.codec.cpu_dequantize import dequantize, restore_layer, restores_here
from kvplugin.cache.codec.protected import (BOUNDARY_ATTR, RECENT_ATTR, RECENT_START_ATTR,
                                            SINK_ATTR, open_gaps, protected_ranges,
                                            restore_protected)
from kvplugin.cache.codec.row_chunks import in_row_chunks
from kvplugin.codecs import (CHANNEL_KEYS, CODEC_ATTR, CODECS, SEED_ATTR, SYM, VALUE_BITS_ATTR,
                             UnknownCodec, fitting_codec)

__all__ = ["SYM", "CHANNEL_KEYS", "ALLOWED_BITS", "DTYPE_ATTR", "SINK_ATTR", "RECENT_ATTR",
           "RECENT_START_ATTR", "BOUNDARY_ATTR", "fitting_codec", "encode_rows",
           "protect_rows", "protected_ranges", "codec_arrays", "check_record", "rows_of",
           "restore_rows", "dtype_name"]

ALLOWED_BITS = (2, 3, 4, 5, 6, 8)
DTYPE_ATTR = "kvplugin_dtype"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # "mlx.core.bfloat16" -> "bfloat16"


def encode_rows(keys: mx.array, values: mx.array, codec: str, bits: int, vbits: int,
                group: int, chunk_bytes: int | None) -> tuple[tuple, tuple]:
    """The codec's arrays of ``keys`` and ``values`` (``codec`` as
    :func:`kvplugin.codecs.fitting_codec` gave
    it): codes, scales, minimums (scale-only values of ``rotated-channel-sym``: codes,
    scales); in row chunks of at most ``chunk_bytes`` input bytes where that helps
    (:func:`kvplugin.cache.codec.row_chunks.in_row_chunks`)."""
    from kvplugin.cache.codec import channel, rotation

    def encode_keys(k: mx.array) -> tuple:
        k = k if codec == "affine" else rotation.rotate(k)
        if codec in CHANNEL_KEYS:
            return channel.quantize_channels(k, group, bits)
        return tuple(mx.quantize(k, group_size=group, bits=bits))

    def encode_values(v: mx.array) -> tuple:
        v = v if codec == "affine" else rotation.rotate(v)
        if codec == SYM:
            from kvplugin.cache.codec.symmetric import quantize_symmetric

            return quantize_symmetric(v, group, vbits)
        return tuple(mx.quantize(v, group_size=group, bits=vbits))

    # affine is one MLX kernel that holds its output only: nothing to gain from chunks
    chunk = None if codec == "affine" else chunk_bytes
    return (in_row_chunks(keys, encode_keys, chunk, group),
            in_row_chunks(values, encode_values, chunk, group))


def rows_of(x: mx.array, ranges: list[tuple[int, int]]) -> mx.array:
    """The rows of ``ranges`` (``(start, count)``, ascending), one after another (one range:
    a view)."""
    if len(ranges) == 1:
        return x[..., ranges[0][0] : sum(ranges[0]), :]
    return mx.concatenate([x[..., a : a + c, :] for a, c in ranges], axis=-2)


def protect_rows(q: Any, keys: mx.array, values: mx.array, ranges: list[tuple[int, int]]) -> None:
    """Keep the rows of ``ranges`` (``(start, count)``: the sinks, any between, the recent
    ones, ascending and disjoint) of the full-precision ``keys``/``values`` on ``q`` as a last
    array, and record where they go. Nothing when no range holds a row."""
    if not any(c for _, c in ranges):
        return
    q.keys += (rows_of(keys, ranges),)
    q.values += (rows_of(values, ranges),)
    (_, sink), *between, (start, recent) = ranges
    setattr(q, SINK_ATTR, sink)
    setattr(q, RECENT_START_ATTR, start)
    setattr(q, RECENT_ATTR, recent)
    if between := [(a, c) for a, c in between if c]:
        setattr(q, BOUNDARY_ATTR, ",".join(f"{a}:{c}" for a, c in between))


def codec_arrays(codec: str, name: str) -> int:
    """Arrays a layer's quantized ``keys`` or ``values`` are stored in before the protected
    rows: ``(codes, scales, minimums)``, values of ``rotated-channel-sym`` ``(codes, scales)``."""
    return 2 if codec == SYM and name == "values" else 3


def check_record(layer: Any, rows: int, codecs: tuple[str, ...] = CODECS) -> tuple[str, int]:
    """The layer's recorded codec and seed, its arrays checked against ``rows`` (the rows it
    holds); :class:`UnknownCodec` for anything else (a codec outside ``codecs``, a record
    from another kvplugin version, damaged arrays), so that an entry is a miss, never
    misread."""
    codec = getattr(layer, CODEC_ATTR, "affine")
    if codec not in codecs:
        raise UnknownCodec(f"stored layer has unknown codec {codec!r}")
    if getattr(layer, "bits", None) not in ALLOWED_BITS:
        raise UnknownCodec(f"stored layer has unknown key bits {getattr(layer, 'bits', None)!r}")
    vbits = getattr(layer, VALUE_BITS_ATTR, layer.bits)
    if vbits not in ALLOWED_BITS:
        raise UnknownCodec(f"stored layer has unknown value bits {vbits!r}")
    seed = getattr(layer, SEED_ATTR, None)
    if codec != "affine" and not _is_int(seed):
        raise UnknownCodec(f"{codec} layer without an integer seed")
    if layer.keys is None:
        return codec, seed if _is_int(seed) else 0
    extra = [len(arrays) - codec_arrays(codec, name) if isinstance(arrays, (tuple, list)) else -1
             for name, arrays in (("keys", layer.keys), ("values", layer.values))]
    if extra == [1, 1]:
        held = sum(count for _, count in protected_ranges(layer))
        if any(x[-1].shape[-2] > held for x in (layer.keys, layer.values)):  # fewer: cut
            raise UnknownCodec("protected tokens without a consistent record")
    elif extra != [0, 0] or hasattr(layer, BOUNDARY_ATTR):
        raise UnknownCodec(f"stored {codec} layer with {extra} arrays past its codec's")
    if codec in CHANNEL_KEYS and rows > 0:
        _check_packed(layer, codec, vbits, rows)
    from kvplugin.cache.codec.prerope import recorded_rope

    recorded_rope(layer, codec)
    return codec, seed if _is_int(seed) else 0


def _check_packed(layer: Any, codec: str, vbits: int, rows: int) -> None:
    """The per-channel keys (and scale-only values) hold what their record says."""
    from kvplugin.cache.codec.channel import scale_rows

    words, scales = layer.keys[0], layer.keys[1]
    if (words.shape[-2] < rows or scales.shape != layer.keys[2].shape
            or scales.shape[-2] < scale_rows(rows, layer.group_size)
            or scales.shape[-1] * layer.bits != words.shape[-1] * 32):
        raise UnknownCodec("per-channel keys whose arrays do not match their record")
    if codec == SYM:
        words, scales = layer.values[0], layer.values[1]
        if (min(words.shape[-2], scales.shape[-2]) < rows
                or scales.shape[-1] * layer.group_size * vbits != words.shape[-1] * 32):
            raise UnknownCodec("scale-only values whose arrays do not match their record")


def _dequantize(parts: Any, n: int, group_size: int, bits: int, dtype: Any) -> mx.array:
    w, scales, biases = (x[..., :n, :] for x in parts[:3])
    out = dequantize(w, scales, biases, group_size, bits)
    return out if out.dtype == dtype else out.astype(dtype)


def _dequantize_codec(layer: Any, codec: str, n: int, vbits: int, dtype: Any):
    """The first ``n`` keys and values as the codec stored them (still rotated)."""
    from kvplugin.cache.codec.channel import dequantize_channels
    from kvplugin.cache.codec.symmetric import dequantize_symmetric

    group = layer.group_size
    keys = (dequantize_channels(layer.keys, n, group, layer.bits, dtype)
            if codec in CHANNEL_KEYS
            else _dequantize(layer.keys, n, group, layer.bits, dtype))
    values = (dequantize_symmetric(layer.values, n, group, vbits, dtype) if codec == SYM
              else _dequantize(layer.values, n, group, vbits, dtype))
    return keys, values


def restore_rows(layer: Any, codec: str, seed: int, n: int, dtype: Any,
                 rope: Any = None, runs: Any = None, gaps_to: int | None = None
                 ) -> tuple[mx.array, mx.array]:
    """The first ``n`` rows of keys and values of a stored layer (its record checked by
    :func:`check_record`), in ``dtype``, left unevaluated where MLX computes them. With MLX
    on the CPU, rotated codecs with 2-, 4- or 8-bit codes restore in numpy
    (:mod:`kvplugin.cache.codec.cpu_dequantize`); elsewhere MLX's kernels. ``rope`` and
    ``runs``: keys stored pre-RoPE get the model's rope back at these positions
    (:mod:`kvplugin.cache.codec.prerope`) before the protected rows, kept as the model
    made them, are written over them. ``gaps_to``: the codes hold only the rows the
    protected ones leave (a ring, :data:`kvplugin.codecs.RING_SLOTS_ATTR`), spread back to
    ``gaps_to`` rows before the rope."""
    vbits = getattr(layer, VALUE_BITS_ATTR, layer.bits)
    kept = [arrays[-1] if len(arrays) > codec_arrays(codec, name) else None
            for name, arrays in (("keys", layer.keys), ("values", layer.values))]
    if restores_here(codec, layer.bits, vbits):
        return restore_layer(layer, codec, seed, n, vbits, kept, dtype, rope, runs, gaps_to)
    keys, values = _dequantize_codec(layer, codec, n, vbits, dtype)
    if codec != "affine":
        from kvplugin.cache.codec.rotation import unrotate

        keys, values = unrotate(keys, seed), unrotate(values, seed)
    if gaps_to is not None:
        ranges = protected_ranges(layer)
        keys, values = open_gaps(keys, ranges, gaps_to), open_gaps(values, ranges, gaps_to)
        n = gaps_to
    if rope is not None:
        from kvplugin.cache.codec.prerope import turn

        keys = turn(keys, rope, runs, 1.0)
    return tuple(restore_protected(x, rows, layer, n) for x, rows in zip((keys, values), kept))
