"""Rotating (sliding-window, ``--max-kv-size``) layers stored quantized, with the whole codec.

Why: mlx-lm's ``QuantizedKVCache`` only describes a linear cache (slots ``[0, offset)``), and
a sliding-window model (Gemma 3: most of its layers) or any model under ``--max-kv-size``
(every layer) keeps its tokens in a ring. A ring's slots go through the same codec as a
plain layer's rows (:mod:`kvplugin.cache.codec.rows`): keys rotated and quantized per
channel over groups of slots (a group is a set of tokens, so the ring's order does not
matter), values per token, the ``keep`` tokens and the newest tokens kept at full precision.
The stored layer records what is needed to give back the very same class, slots, ``_idx``,
``offset``, ``keep`` and ``max_size`` on reuse.

Which slots are protected (where the codec protects sinks and recent tokens at all): the
first ``keep`` slots always hold the first ``keep`` tokens, the ring's attention sinks (an
unwrapped ring holds tokens in order, so its first sink tokens too); the newest token is in
slot ``_idx - 1``, and older ones go back through the ring ``[keep, slots)``, wrapping past
its end (recorded as a range between the sinks and the recent rows). Protected slots are
stored at full precision only: the codes hold the other slots, in slot order, and the layer
records the slots it restores to (:data:`kvplugin.codecs.RING_SLOTS_ATTR`). A ring is never
reused row by row, so nothing needs its protected rows among the codes (a plain layer's
prefix copy does), and a sink's large key stays out of its group's range. A ring that has not
wrapped can still be cut to a shorter prefix, as stock trims it (:meth:`~QuantizedRotatingKVCache.cut`):
restored whole, then trimmed.
A record without the slot count (kvplugin before 2026-12-07) holds every slot among the codes.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from kvplugin.cache.codec import rotation
from kvplugin.cache.codec.channel import scale_rows
from kvplugin.cache.codec.prerope import KEY_ROPE_ATTR, check_rope, ring_runs, turn
from kvplugin.cache.codec.protected import free_ranges
from kvplugin.cache.layers import LayerKind, register_kind
from kvplugin.cache.codec.rows import (BOUNDARY_ATTR, CHANNEL_KEYS, RECENT_ATTR,
                                          RECENT_START_ATTR, SINK_ATTR, check_record,
                                          codec_arrays, dtype_name, encode_rows,
                                          fitting_codec, protect_rows, protected_ranges,
                                          restore_rows, rows_of)
from kvplugin.codecs import (CODEC_ATTR, RING_SLOTS_ATTR, SEED_ATTR, VALUE_BITS_ATTR,
                             UnknownCodec)

__all__ = ["QuantizedRotatingKVCache", "quantize_rotating", "dequantize_rotating",
           "is_rotating_quantizable", "rotating_codec", "protected_slots", "coded_keys"]


#: On a served copy only, never stored: restore the first this many tokens (:meth:`cut`).
CUT_ATTR = "kvplugin_cut_to"


class QuantizedRotatingKVCache:
    """A stored rotating layer: the codec's arrays over its slots, and how to restore it.

    Not a cache the host can run (it is only ever in the store): ``offset`` is the tokens the
    layer has seen; it holds :data:`RING_SLOTS_ATTR` slots (where recorded; else
    ``keys[0].shape[-2]``, the rows its codes hold).
    """

    #: Record attributes a stored layer may carry besides those ``__init__`` sets
    OPTIONAL = (VALUE_BITS_ATTR, SINK_ATTR, RECENT_START_ATTR, RECENT_ATTR, BOUNDARY_ATTR,
                KEY_ROPE_ATTR, RING_SLOTS_ATTR)

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

    def can_cut(self, n: int) -> bool:
        """Whether :meth:`cut` can give the first ``n`` tokens: only from a ring that has not
        wrapped and is not full (its slots hold tokens ``[0, offset)`` in order), as
        stock's ``RotatingKVCache.is_trimmable``."""
        return (self.keys is not None and 1 <= n <= self.offset < self.max_size
                and self._idx == self.offset)

    def cut(self, n: int) -> QuantizedRotatingKVCache | None:
        """The same stored arrays (shared, nothing copied) marked to restore as the first
        ``n`` tokens (:data:`CUT_ATTR`; :func:`dequantize_rotating` trims the restored ring),
        for another conversation sharing a prefix (:func:`kvplugin.cache.layers.copy_prefix`).
        None where it cannot (:meth:`can_cut`)."""
        if not self.can_cut(n):
            return None
        new = copy.copy(self)
        setattr(new, CUT_ATTR, min(n, getattr(self, CUT_ATTR, n)))
        return new

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


def held_slots(layer: RotatingKVCache) -> int:
    """Slots holding tokens: an unwrapped ring's first ``offset`` (the rest is growth slack),
    else all of them."""
    size = layer.keys.shape[-2]
    return layer.offset if layer.offset < size and layer._idx == layer.offset else size


def protected_slots(offset: int, slots: int, keep: int, idx: int, sink: int,
                    recent: int) -> list[tuple[int, int]]:
    """``(start, count)`` ranges of the slots kept at full precision, ascending: the head
    (``keep``; ``max(keep, sink)`` while the ring holds its tokens in order; none where the
    codec protects no sinks, ``sink == 0``), the newest ``recent`` slots going back from
    ``idx - 1`` (two ranges where they wrap past the end)."""
    in_order = offset <= slots
    head = 0 if sink <= 0 else min(slots, max(keep, sink) if in_order else keep)
    newest = min(recent, slots - head)
    before = min(newest, max(0, idx - head))
    after = 0 if in_order else newest - before
    if after:
        return [(0, head), (idx - before, before), (slots - after, after)]
    return [(0, head), (idx - before, before)]


def coded_keys(layer: RotatingKVCache, codec: str, rope: Any = None) -> tuple[mx.array, Any]:
    """The ring's held keys as ``codec`` (fitted to the widths) quantizes them, and the rope
    taken out of them (None where none is): pre-RoPE at each slot's position where ``rope``
    is given, the codec stores keys per channel and the ring's positions are known."""
    slots = held_slots(layer)
    keys = layer.keys[..., :slots, :]
    if codec not in CHANNEL_KEYS:
        return keys, None
    runs = ring_runs(layer.offset, slots, layer.keep, min(layer._idx, slots))
    rope = rope if runs is not None else None
    return (keys if rope is None else turn(keys, rope, runs, -1.0)), rope


def quantize_rotating(layer: RotatingKVCache, bits: int, group_size: int,
                      codec: str = "affine", value_bits: int | None = None, sink: int = 0,
                      recent: int = 0, chunk_bytes: int | None = None, rope: Any = None
                      ) -> QuantizedRotatingKVCache:
    """The ring's held slots through ``codec`` (as a plain layer's rows; widths it cannot take
    fall back as :func:`kvplugin.codecs.fitting_codec` says, recorded), keys at
    ``bits``, values at ``value_bits``, the head and the newest ``recent`` slots kept at full
    precision (see :func:`protected_slots`). ``rope``: the layer's key rope, taken out at
    each slot's position before a per-channel codec (:mod:`kvplugin.cache.codec.prerope`)."""
    q = QuantizedRotatingKVCache()
    slots = held_slots(layer)
    keys, values = layer.keys[..., :slots, :], layer.values[..., :slots, :]
    vbits = bits if value_bits is None else value_bits
    codec = fitting_codec(codec, keys.shape[-1], values.shape[-1])
    ranges = protected_slots(layer.offset, slots, layer.keep, layer._idx, sink, recent)
    coded, rope = coded_keys(layer, codec, rope)
    free, coded_values = free_ranges(ranges, slots), values
    if free and free != [(0, slots)]:  # the protected slots only at full precision
        coded, coded_values = rows_of(coded, free), rows_of(values, free)
        setattr(q, RING_SLOTS_ATTR, slots)
    q.keys, q.values = encode_rows(coded, coded_values, codec, bits, vbits, group_size,
                                   chunk_bytes)
    protect_rows(q, keys, values, ranges)
    setattr(q, CODEC_ATTR, codec)
    if codec != "affine":
        setattr(q, SEED_ATTR, rotation.CODEC_SEED)
    if rope is not None:
        setattr(q, KEY_ROPE_ATTR, rope.record)
    if vbits != bits:
        setattr(q, VALUE_BITS_ATTR, vbits)
    q.offset, q.max_size, q.keep = layer.offset, layer.max_size, layer.keep
    q._idx = min(layer._idx, slots)
    q.bits, q.group_size = bits, group_size
    q.dtype_name = dtype_name(layer.keys.dtype)
    q.cls = f"{type(layer).__module__}:{type(layer).__qualname__}"
    q.step = vars(layer).get("step")
    return q


def _resolve(spec: str) -> type:
    """The recorded rotating class if its module is already imported (the spec may come from
    a cold-tier file: nothing is imported from data), else ``RotatingKVCache``."""
    module, _, name = str(spec).partition(":")
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) and issubclass(cls, RotatingKVCache) else RotatingKVCache


def _slots(q: QuantizedRotatingKVCache) -> tuple[int, int]:
    """The rows the stored layer's codes hold and the slots it restores to (more where the
    protected slots are held at full precision only)."""
    ints = (q.offset, q.max_size, q.keep, q._idx, q.group_size)
    if (not all(type(x) is int and x >= 0 for x in ints) or q.group_size == 0
            or not isinstance(q.keys, tuple) or not isinstance(q.values, tuple)
            or not q.keys or not q.values):
        raise UnknownCodec("stored rotating layer without a consistent record")
    stored = q.keys[0].shape[-2]
    slots = getattr(q, RING_SLOTS_ATTR, stored)
    if (type(slots) is not int or slots < stored or q.values[0].shape[-2] != stored
            or q._idx > slots or q.keep > slots):
        raise UnknownCodec("stored rotating layer whose slots do not match its record")
    return stored, slots


def rotating_codec(q: QuantizedRotatingKVCache) -> tuple[str, int]:
    """The stored layer's codec and seed; :class:`UnknownCodec` for one this version cannot
    read (a record from a newer kvplugin, or a damaged one): a miss, never misread."""
    stored, slots = _slots(q)
    codec, seed = check_record(q, stored)
    if codec != "affine" and not all(rotation.rotatable(p.shape[-1] * 32 // bits) for p, bits
                                     in ((q.keys[0], q.bits),
                                         (q.values[0], getattr(q, VALUE_BITS_ATTR, q.bits)))):
        raise UnknownCodec(f"{codec} window layer without a power-of-two width")
    for name, parts in (("keys", q.keys), ("values", q.values)):
        per_group = name == "keys" and codec in CHANNEL_KEYS
        want = scale_rows(stored, q.group_size) if per_group else stored
        if any(p.shape[-2] != want for p in parts[1:codec_arrays(codec, name)]):
            raise UnknownCodec(f"stored rotating layer whose {name} scales do not match")
    held = 0
    if len(q.keys) > codec_arrays(codec, "keys"):
        ranges = protected_ranges(q)
        held = sum(c for _, c in ranges)
        if (max(a + c for a, c in ranges) > slots
                or any(p[-1].shape[-2] != held for p in (q.keys, q.values))):
            raise UnknownCodec("stored rotating layer whose protected slots do not match")
    if slots != stored and stored + held != slots:
        raise UnknownCodec("stored rotating layer whose codes and protected slots do not add up")
    return codec, seed


def dequantize_rotating(q: QuantizedRotatingKVCache, rope: Any = None) -> RotatingKVCache:
    """The same rotating layer back, full precision (left unevaluated: the caller's lanes
    evaluate, :func:`kvplugin.cache.codec.quantize.dequantize_entry`); ``rope``: the serving
    model's rope of this layer, put back where its keys were stored pre-RoPE with it (else
    :class:`UnknownCodec`)."""
    codec, seed = rotating_codec(q)
    cls = _resolve(q.cls)
    layer = cls.__new__(cls)
    RotatingKVCache.__init__(layer, q.max_size, q.keep)
    dtype = getattr(mx, q.dtype_name, mx.float16)
    dtype = dtype if isinstance(dtype, mx.Dtype) else mx.float16
    rope = check_rope(q, codec, rope)  # None for keys stored post-RoPE
    stored, slots = _slots(q)
    runs = None if rope is None else ring_runs(q.offset, slots, q.keep, q._idx)
    if rope is not None and runs is None:
        raise UnknownCodec("stored rotating layer with pre-RoPE keys and no slot positions")
    keys, values = restore_rows(q, codec, seed, stored, dtype, rope, runs,
                                None if slots == stored else slots)
    layer.keys = keys if keys.dtype == dtype else keys.astype(dtype)
    layer.values = values if values.dtype == dtype else values.astype(dtype)
    layer.offset, layer._idx = q.offset, q._idx
    if q.step is not None:
        layer.step = q.step
    cut = getattr(q, CUT_ATTR, None)
    if isinstance(cut, int) and 0 < cut < layer.offset:  # a prefix of an unwrapped ring
        layer.trim(layer.offset - cut)
        if layer.offset != cut:  # the class would not give it: a miss, never misread
            raise UnknownCodec(f"a stored {q.cls} ring that cannot be cut to {cut} tokens")
    return layer
