"""Encoding a layer in row chunks, so that a codec pass holds a bounded share of the entry.

Why a module of its own: it is the one place that decides how much of an entry a codec pass
may hold in temporaries (``CHUNK_SHARE``), for every codec :mod:`kvplugin.cache.codec.quantize`
writes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList

__all__ = ["CHUNK_SHARE", "in_row_chunks", "used_bytes"]

#: A codec pass encodes at most this share of the whole entry at once (see in_row_chunks)
CHUNK_SHARE = 32


def in_row_chunks(x: mx.array, encode: Any, chunk_bytes: int | None, group: int) -> tuple:
    """``encode(x)``, or, when ``x`` is larger than ``chunk_bytes``, ``encode`` over chunks
    of its rows (a multiple of ``group`` rows each), each chunk evaluated and written in place
    into the result arrays before the next is made.

    Why: encoding a layer holds several times that layer in temporaries (the rotation and
    per-channel keys ~7x an fp16 layer at 4 bits), and MLX builds them all at once for one
    graph. On a model with few layers one layer is a large share of the entry: a 2-layer
    model's 4-bit store peaked at 3.2x the entry above what it held, and a real server's
    process high-water mark on the sequential path rose ~2.8 MiB above stock's for a 1.5
    MiB entry. Chunked at 1/32 of the entry (``CHUNK_SHARE``), a pass holds a few chunks and
    the codes. Every codec here quantizes a row (per-channel keys: a group of rows) on its
    own, so the result is bit for bit the unchunked one. A model with 16 layers or more
    (a layer's keys at most 1/32 of the entry) takes one pass per array, as before, and
    keeps its two lanes (:mod:`kvplugin.cache.codec.lanes`); a chunked layer's lane evaluates as
    it goes, so its layers run one after the other."""
    rows = x.shape[-2]
    row_bytes = x.nbytes // rows if rows else 0
    if not chunk_bytes or not row_bytes or x.nbytes <= chunk_bytes:
        return encode(x)
    step = max(group, chunk_bytes // row_bytes // group * group)
    if rows <= step:
        return encode(x)
    out: list[mx.array] = []
    full: list[int] = []  # each array's rows per whole chunk: step (per token) or step/group
    for start in range(0, rows, step):
        part = encode(x[..., start : start + step, :])
        if not out:  # the joined arrays, filled in place chunk by chunk (no concatenation)
            full = [a.shape[-2] for a in part]
            out = [mx.zeros((*a.shape[:-2], -(-rows * f // step), a.shape[-1]), a.dtype)
                   for a, f in zip(part, full)]
        for i, a in enumerate(part):
            at = start // step * full[i]
            out[i][..., at : at + a.shape[-2], :] = a
        del part
        mx.eval(out)
    return tuple(out)


def used_bytes(layer: Any) -> int:
    """Bytes of the rows a plain K/V layer uses (nested children too); 0 for anything else."""
    if type(layer) is CacheList:  # nested (Falcon-H1): its K/V children
        return sum(used_bytes(child) for child in layer.caches)
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    n = getattr(layer, "offset", 0)
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array)
            and isinstance(n, int) and not isinstance(n, bool)):
        return 0
    per_row = sum(a.nbytes // max(1, a.shape[-2]) for a in (keys, values))
    return per_row * min(n, keys.shape[-2])
