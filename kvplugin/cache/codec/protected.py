"""Protected rows: the tokens a quantized layer also keeps at full precision (the first
sinks, rows before earlier prompt boundaries or past a ring's wrap, the newest rows), where
they go, and writing them back over the dequantized rows.

Why a leaf of its own: the codec that stores them and the CPU path that restores them both
need it, and neither may import the other.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvplugin.codecs import UnknownCodec

__all__ = ["BOUNDARY_ATTR", "RECENT_ATTR", "RECENT_START_ATTR", "SINK_ATTR",
           "protected_ranges", "restore_protected", "free_ranges", "open_gaps"]

SINK_ATTR = "kvplugin_sink_tokens"
RECENT_ATTR = "kvplugin_recent_tokens"
RECENT_START_ATTR = "kvplugin_recent_start"
# Rows before earlier prompt boundaries (plain layers), or a ring's newest rows where they
# wrap past its end (rotating layers): between the sinks and the recent rows.
BOUNDARY_ATTR = "kvplugin_boundary_rows"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def protected_ranges(layer: Any) -> list[tuple[int, int]]:
    """Where a layer's full-precision rows go, in the order it holds them: ``(start, count)``
    of the sinks, the rows between, the recent rows. :class:`UnknownCodec` for a record that
    does not add up."""
    vals = [getattr(layer, a, None) for a in (SINK_ATTR, RECENT_START_ATTR, RECENT_ATTR)]
    if not all(_is_int(v) and v >= 0 for v in vals):
        raise UnknownCodec("protected tokens without a consistent record")
    sink, start, recent = vals
    ranges, low = [(0, sink)], sink
    text = getattr(layer, BOUNDARY_ATTR, "")
    for item in text.split(",") if isinstance(text, str) and text else ():
        a, _, c = item.partition(":")
        if not (a.isdigit() and c.isdigit()) or int(a) < low or int(c) < 1:
            raise UnknownCodec(f"protected boundary rows {text!r} not ascending and disjoint")
        ranges.append((int(a), int(c)))
        low = int(a) + int(c)
    if not isinstance(text, str) or low > start:
        raise UnknownCodec(f"protected boundary rows {text!r} past the recent rows")
    return ranges + [(start, recent)]


def restore_protected(out: mx.array, kept: mx.array | None, layer: Any, n: int) -> mx.array:
    """Write the full-precision rows ``kept`` (those still below ``n``, and still held: a
    prefix copy cuts that array too) over ``out``."""
    if kept is None:
        return out
    row = 0
    for start, count in protected_ranges(layer):
        stop = min(start + count, n, start + max(0, kept.shape[-2] - row))
        if stop > start:
            out[..., start:stop, :] = kept[..., row : row + stop - start, :].astype(out.dtype)
        row += count
    return out


def free_ranges(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``(start, count)`` of the rows below ``n`` that ``ranges`` (ascending, disjoint) leave."""
    free, at = [], 0
    for start, count in [r for r in ranges if r[1]] + [(n, 0)]:
        if start > at:
            free.append((at, start - at))
        at = max(at, start + count)
    return free


def open_gaps(x: Any, ranges: list[tuple[int, int]], n: int) -> Any:
    """``x``'s rows (the codes of the rows ``ranges`` leave, in order) spread over ``n`` rows,
    zeros where ``ranges`` are, for :func:`restore_protected` to fill; an MLX or numpy array."""
    zeros, concatenate = ((mx.zeros, mx.concatenate) if isinstance(x, mx.array)
                          else (np.zeros, np.concatenate))
    pieces, row, at = [], 0, 0
    for start, count in free_ranges(ranges, n) + [(n, 0)]:
        if start > at:  # a protected range
            pieces.append(zeros((*x.shape[:-2], start - at, x.shape[-1]), dtype=x.dtype))
        if count:
            pieces.append(x[..., row : row + count, :])
        row, at = row + count, start + count
    return concatenate(pieces, axis=-2)
