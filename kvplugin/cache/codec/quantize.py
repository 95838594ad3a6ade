"""Quantize / dequantize stored KV entries into mlx-lm's own ``QuantizedKVCache``.

Why mlx-lm's class: its attention goes quantized iff the layer cache ``hasattr(cache, "bits")``
(``models/base.py``), so an entry of ``QuantizedKVCache`` layers can be handed back to the
sequential generation path as it is, and ``save_prompt_cache``/``load_prompt_cache`` know it.
The batched path cannot merge quantized layers, hence :func:`dequantize_entry`.

Stored size: per ``D`` fp16 values a group-``g`` ``b``-bit layer stores ``D*b/8`` packed bytes +
``2*(D/g)`` scales/biases of 2 bytes, i.e. ``b/16 + 2/g`` of fp16 (8-bit/64: 0.53125, 4-bit/64:
0.28125), provided the layer holds exactly ``offset`` tokens, which is why we quantize the used
slots only (``KVCache.to_quantized`` would quantize the spare capacity too).

The original dtype is the dtype of the scales (``mx.quantize`` keeps the input's), so it survives
save/load; it is also recorded on the layer as ``kvplugin_dtype``, a dtype *name* (``"bfloat16"``):
an ``mx.Dtype`` attribute cannot be deep-copied, and mlx-lm's prompt cache deep-copies entries.

Imports only ``mlx.core`` and ``mlx_lm.models.cache``; works on mlx-lm 0.31.3 and 0.32.x.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from kvplugin.cache.codec.lanes import in_lanes
from kvplugin.cache.codec.row_chunks import CHUNK_SHARE, used_bytes
from kvplugin.cache.model.widths import (ALLOWED_GROUP_SIZES, cache_widths, head_dim_of,
                                         validate_group_size_for_model)
from kvplugin.cache.layers import is_quantizable, with_children
from kvplugin.cache.codec.rows import (ALLOWED_BITS, BOUNDARY_ATTR, CHANNEL_KEYS,
                                          DTYPE_ATTR, RECENT_ATTR, RECENT_START_ATTR,
                                          SINK_ATTR, SYM, check_record, codec_arrays,
                                          dtype_name, encode_rows, fitting_codec,
                                          protect_rows, protected_ranges, restore_rows)
from kvplugin.codecs import (CODEC_ATTR, CODECS, SEED_ATTR, VALUE_BITS_ATTR, CodecPlan,
                             UnknownCodec, layer_bits_group)

__all__ = [
    "ALLOWED_BITS", "ALLOWED_GROUP_SIZES", "DTYPE_ATTR", "CODECS", "UnknownCodec",
    "codec_name", "QuantizeResult", "validate_bits_group", "head_dim_of",
    "validate_group_size_for_model", "quantize_entry", "dequantize_entry",
    "codec_arrays",
]

# What a stored layer records about its codec: kvplugin.cache.codec.rows. Protected
# tokens: the first sinks, the rows before earlier prompt boundaries and the recent rows kept
# at full precision as a last array, written over the dequantized rows. Why the boundary
# rows: a repeated or edited turn reuses a *prefix* of a later entry, and then these are its
# last tokens, the ones the next token attends to most (docs/benchmarks.md, "Prompt
# boundaries"). The last array holds every protected row in position order, so cutting it
# to its first m rows (a trim, a prefix copy) keeps exactly the protected rows below m; a
# later trim shortens the codec's arrays only, and rows past the offset are not copied back.


@dataclass
class QuantizeResult:
    """Outcome of :func:`quantize_entry`.

    ``cache`` is a new list (the input itself with ``consume``); ``quantized`` counts layers
    turned into ``QuantizedKVCache`` or, for rotating layers, ``QuantizedRotatingKVCache``;
    ``skipped`` counts layers left as they were (recurrent, already quantized, empty, head
    dimension not divisible by the group size, unknown kinds).
    """

    cache: list
    quantized: int
    skipped: int


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_bits_group(bits: int, group_size: int) -> None:
    """Raise ``ValueError`` unless ``mx.quantize`` supports ``bits`` and ``group_size``."""
    if not _is_int(bits) or bits not in ALLOWED_BITS:
        raise ValueError(f"KV quantization bits must be one of {ALLOWED_BITS}, got {bits!r}")
    if not _is_int(group_size) or group_size not in ALLOWED_GROUP_SIZES:
        raise ValueError(
            f"KV quantization group size must be one of {ALLOWED_GROUP_SIZES}, got {group_size!r}"
        )


def _boundary_ranges(boundaries: Any, width: int, low: int, high: int) -> list[tuple[int, int]]:
    """``(start, count)`` of the ``width`` tokens before each boundary, cut to ``[low, high)``
    (between the sinks and the recent rows), merged where they touch."""
    ranges: list[list[int]] = []
    for b in sorted(set(boundaries)) if width > 0 else ():
        a, e = max(low, b - width), min(high, b)
        if e <= a:
            continue
        if ranges and a <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], e)
        else:
            ranges.append([a, e])
    return [(a, e - a) for a, e in ranges]


def _quantize_layer(
    layer: KVCache,
    bits: int,
    group_size: int,
    codec: str = "affine",
    value_bits: int | None = None,
    sink: int = 0,
    recent: int = 0,
    boundaries: Any = (),
    stored: Any = None,
    chunk_bytes: int | None = None,
    rope: Any = None,
) -> QuantizedKVCache:
    """``bits`` are the keys' (``layer.bits``); values use ``value_bits`` (recorded when they
    differ). ``rotated`` needs power-of-two widths (``rotated-channel`` also 32 or more); a
    layer without them is stored ``affine`` (recorded as such, so it is read back right).
    ``rotated-channel`` keys are quantized per channel in groups of ``group_size`` tokens
    (:mod:`kvplugin.cache.codec.channel`). ``sink``/``recent`` tokens, and ``recent`` tokens before
    each of ``boundaries``, are kept at full precision besides (their quantized rows stay
    too: exact-size arrays, simple trims). ``stored``: this layer of a stored entry that
    holds this entry's first tokens (see :func:`_reusable_rows`). ``chunk_bytes``: encode
    the keys and the values in row chunks of at most this many input bytes
    (:func:`kvplugin.cache.codec.row_chunks.in_row_chunks`). ``rope``: the layer's key rope
    (:mod:`kvplugin.cache.model.rope`), taken out of the keys before a per-channel codec
    (:mod:`kvplugin.cache.codec.prerope`); the protected rows stay as the model made them."""
    from kvplugin.cache.codec import prerope, rotation

    n = layer.offset
    keys, values = layer.keys[..., :n, :], layer.values[..., :n, :]
    vbits = bits if value_bits is None else value_bits
    codec = fitting_codec(codec, keys.shape[-1], values.shape[-1])
    q = QuantizedKVCache(group_size=group_size, bits=bits)
    if codec != "affine":
        setattr(q, SEED_ATTR, rotation.CODEC_SEED)
    rope = rope if codec in CHANNEL_KEYS else None
    if rope is not None:
        setattr(q, prerope.KEY_ROPE_ATTR, rope.record)
    reused = _reusable_rows(stored, codec, bits, vbits, group_size, keys, values,
                            getattr(q, prerope.KEY_ROPE_ATTR, None))
    # Rows a stored prefix of this entry already holds are copied, not quantized again: the
    # codec's cost then follows the tokens a turn adds, not the conversation's length, and
    # every row is quantized once, from the values the model computed.
    key_rows = reused // group_size * group_size if codec in CHANNEL_KEYS else reused
    coded = keys[..., key_rows:, :]
    if rope is not None:  # rows from key_rows on, at their positions
        coded = prerope.turn(coded, rope, ((0, n - key_rows, key_rows),), -1.0)
    q.keys, q.values = encode_rows(coded, values[..., reused:, :], codec,
                                   bits, vbits, group_size, chunk_bytes)
    if key_rows:
        per_group = codec in CHANNEL_KEYS  # scales/minimums: one row per group of tokens
        q.keys = _joined(stored.keys, q.keys, key_rows, key_rows // group_size if per_group
                         else key_rows)
    if reused:
        q.values = _joined(stored.values, q.values, reused, reused)
    sink = min(sink, n)
    start = max(sink, n - recent)
    between = _boundary_ranges(boundaries, recent, sink, start)
    protect_rows(q, keys, values, [(0, sink), *between, (start, n - start)])
    q.offset = n
    setattr(q, DTYPE_ATTR, dtype_name(keys.dtype))
    setattr(q, CODEC_ATTR, codec)
    if vbits != bits:
        setattr(q, VALUE_BITS_ATTR, vbits)
    if "step" in vars(layer):  # a configured growth step keeps applying after reuse
        q.step = layer.step
    return q


def _reusable_rows(stored: Any, codec: str, bits: int, vbits: int, group_size: int,
                   keys: mx.array, values: mx.array, rope_record: str | None = None) -> int:
    """How many leading rows of ``stored`` (a layer of a stored entry whose tokens begin this
    entry's) can be copied as they are: its ``offset`` when it was written with exactly this
    codec, widths, dtype and head layout, else 0 (quantized afresh). Why it is safe: a plain
    layer's row ``i`` is token ``i``'s key and value, which depend on the tokens before it
    only, and every codec here quantizes a row (per-channel keys: a group of rows) on its
    own, so the stored codes are those of this entry's first rows (pre-RoPE keys too: a
    row's rope depends on its position only, ``rope_record`` the same)."""
    from kvplugin.cache.codec.prerope import KEY_ROPE_ATTR
    from kvplugin.cache.codec.rotation import CODEC_SEED

    if type(stored) is not QuantizedKVCache or stored.keys is None:
        return 0
    m = stored.offset
    same = (getattr(stored, CODEC_ATTR, "affine") == codec and stored.bits == bits
            and stored.group_size == group_size
            and getattr(stored, VALUE_BITS_ATTR, bits) == vbits
            and getattr(stored, DTYPE_ATTR, None) == dtype_name(keys.dtype)
            and getattr(stored, KEY_ROPE_ATTR, None) == rope_record
            and (codec == "affine" or getattr(stored, SEED_ATTR, None) == CODEC_SEED))
    if not same or not 0 < m <= keys.shape[-2]:
        return 0
    try:
        _codec_of(stored)
    except UnknownCodec:
        return 0
    codes = (stored.keys[0], stored.values[0])  # packed: width * bits / 32 words a row
    if (min(x.shape[-2] for x in codes) < m or any(x.shape[:-2] != keys.shape[:-2] for x in codes)
            or codes[0].shape[-1] * 32 != keys.shape[-1] * bits
            or codes[1].shape[-1] * 32 != values.shape[-1] * vbits):
        return 0
    return m


def _joined(stored: Any, fresh: tuple, rows: int, scale_rows: int) -> tuple:
    """The codec's arrays: ``stored``'s first rows (codes: ``rows``, scales and minimums:
    ``scale_rows``), then ``fresh``'s (:func:`_reusable_rows` checked their widths)."""
    return tuple(mx.concatenate([a[..., : (rows if i == 0 else scale_rows), :], b], axis=-2)
                 for i, (a, b) in enumerate(zip(stored, fresh)))


def quantize_entry(
    cache: list,
    *,
    bits: int,
    group_size: int,
    consume: bool = False,
    codec: str = "affine",
    value_bits: int | None = None,
    sink_tokens: int = 0,
    recent_tokens: int = 0,
    prompt_boundaries: Any = (),
    stored_prefix: list | None = None,
    chunk_bytes: int | None = None,
    quantize_state: bool = False,
    key_ropes: Any = None,
    wide_head_keys: tuple[int, int, int] | None = None,
    ranked_key_bits: int | None = None,
) -> QuantizeResult:
    """Quantize an entry's K/V layers: plain ``KVCache`` to exact-size ``QuantizedKVCache``,
    rotating ones (sliding windows, ``--max-kv-size``) to ``QuantizedRotatingKVCache``
    (:mod:`kvplugin.cache.codec.rotating`), which gives back the same rotating layer.

    Only the ``offset`` used slots are quantized (no separate trim needed). Everything else is
    left as it is and counted in ``skipped``: ``ArraysCache``/recurrent state, layers already ``QuantizedKVCache`` (e.g. from mlx-lm's
    ``--kv-bits``; never quantized twice), empty layers, layers whose key/value last dimension
    is not divisible by ``group_size``, and unknown kinds. Each new layer is evaluated as soon as
    it is made; with ``consume`` it also replaces the original in ``cache`` right away, so the
    full-precision entry is freed layer by layer (transient: one layer, not one entry).
    ``prompt_boundaries``: token counts where earlier prompts ended; the ``recent_tokens``
    before each are kept at full precision too (plain layers; a window holds no history).
    ``stored_prefix``: a stored entry (as this codec stored it) of this entry's first
    tokens, the same model's layers in the same order; the rows it holds are copied rather
    than quantized again wherever it was stored with this very codec (plain layers). With
    ``consume`` each of its layers is dropped from that list once used. ``chunk_bytes``:
    the most input bytes one codec pass encodes at once (default: 1/``CHUNK_SHARE`` of the
    entry's used rows; see :mod:`kvplugin.cache.codec.row_chunks`). ``quantize_state``: recurrent
    state (``ArraysCache``) stored rotated at 8 bits too (:mod:`kvplugin.cache.codec.state`).
    ``key_ropes``: each layer's key rope or None (:func:`kvplugin.cache.model.rope.key_ropes`,
    one per layer of ``cache``): per-channel keys of those layers are stored pre-RoPE.
    ``wide_head_keys``: (key bits, value bits, group) of layers whose heads that group divides
    (:func:`kvplugin.codecs.layer_bits_group`). ``ranked_key_bits``: the keys of the layers
    the codec quantizes worst at these bits, paid for by others' (:mod:`.ranked`).
    """
    validate_bits_group(bits, group_size)
    if value_bits is not None:
        validate_bits_group(value_bits, group_size)
    if codec not in CODECS:
        raise ValueError(f"unknown KV cache codec {codec!r}; one of {', '.join(CODECS)}")
    out = cache if consume else list(cache)
    quantized = skipped = 0
    from kvplugin.cache.codec.rotating import is_rotating_quantizable, quantize_rotating
    from kvplugin.cache.codec.state import QuantizedArraysCache, is_state_quantizable
    from kvplugin.cache.codec.state import quantize_state as quantize_state_layer

    if chunk_bytes is None:
        chunk_bytes = sum(used_bytes(layer) for layer in cache) // CHUNK_SHARE
    donors = (stored_prefix if stored_prefix is not None
              and len(stored_prefix) == len(cache) else [None] * len(cache))
    ropes = (list(key_ropes) if key_ropes is not None and len(key_ropes) == len(cache)
             else [None] * len(cache))
    def bits_of(layer: Any) -> tuple[int, int, int]:
        keys = getattr(layer, "keys", None)  # a quantized layer's are a tuple: kept as is
        return (layer_bits_group(bits, value_bits or bits, group_size, wide_head_keys,
                                 keys.shape[-1], layer.values.shape[-1])
                if isinstance(keys, mx.array) else (bits, value_bits or bits, group_size))

    def fits(layer: Any) -> tuple[int, int, int] | None:
        got = bits_of(layer)
        return got if is_quantizable(layer, got[2]) or is_rotating_quantizable(
            layer, got[2]) else None

    from kvplugin.cache.codec.ranked import layer_key_bits
    raised = {} if ranked_key_bits is None else layer_key_bits(
        cache, ranked_key_bits, codec, fits, ropes)

    def one(item: tuple[int, Any]) -> tuple[int, Any]:
        i, layer = item
        if type(layer) is CacheList:  # nested (Falcon-H1: state + attention): its K/V children
            kids = getattr(donors[i], "caches", None)
            return i, quantize_entry(list(layer.caches), bits=bits, group_size=group_size,
                                     codec=codec, value_bits=value_bits,
                                     sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                     prompt_boundaries=prompt_boundaries,
                                     stored_prefix=None if kids is None else list(kids),
                                     chunk_bytes=chunk_bytes, quantize_state=quantize_state,
                                     wide_head_keys=wide_head_keys)
        kbits, vbits, group = bits_of(layer)
        kbits = raised.get(i, kbits)
        if is_quantizable(layer, group):
            return i, _quantize_layer(layer, kbits, group, codec, vbits, sink_tokens,
                                      recent_tokens, prompt_boundaries, donors[i], chunk_bytes,
                                      ropes[i])
        if is_rotating_quantizable(layer, group):
            return i, quantize_rotating(layer, kbits, group, codec, vbits, sink_tokens,
                                        recent_tokens, chunk_bytes, ropes[i])
        if quantize_state and is_state_quantizable(layer):
            return i, quantize_state_layer(layer)
        return i, None

    def made(result: tuple[int, Any]) -> list:
        q = result[1]
        if isinstance(q, QuantizedArraysCache):
            return [a for part in q.cache if part is not None
                    for a in (part if isinstance(part, tuple) else (part,))]
        return [] if q is None or isinstance(q, QuantizeResult) else list(q.keys + q.values)

    for i, q in in_lanes(enumerate(cache), one, made):
        if consume:
            donors[i] = None  # its rows are copied: a layer nothing else holds goes now
        if isinstance(q, QuantizeResult):  # a CacheList's children
            skipped += q.skipped
            if q.quantized:
                out[i] = with_children(cache[i], q.cache)
                quantized += 1
        elif q is None:
            skipped += 1
        else:
            out[i] = q
            quantized += 1
    return QuantizeResult(cache=out, quantized=quantized, skipped=skipped)


def matches_live(layer: Any, bits: int, group_size: int, start: int) -> bool:
    """A stored quantized layer the host's own quantized live cache (mlx-lm ``--kv-bits``
    ``--kv-group-size``, from ``--quantized-kv-start`` tokens on) would hold as it is: same
    bits and group size, past the start. Handed back so, it skips a dequantize-then-
    requantize round trip (slower, and lossy twice)."""
    return (type(layer) is QuantizedKVCache and layer.bits == bits
            and layer.group_size == group_size and layer.offset >= start
            and getattr(layer, CODEC_ATTR, "affine") == "affine"
            and getattr(layer, VALUE_BITS_ATTR, bits) == bits
            and isinstance(layer.keys, (tuple, list)) and len(layer.keys) == 3)


def _original_dtype(layer: QuantizedKVCache) -> Any:
    dtype = getattr(mx, str(getattr(layer, DTYPE_ATTR, "")), None)
    if isinstance(dtype, mx.Dtype):
        return dtype
    if layer.keys is not None and len(layer.keys) > 1:
        return layer.keys[1].dtype  # scales carry the input dtype
    return mx.float16


def _codec_of(layer: Any) -> tuple[str, int]:
    """A plain stored layer's codec and seed (:func:`kvplugin.cache.codec.rows.check_record`
    over its ``offset`` rows)."""
    return check_record(layer, layer.offset)


def codec_name(layer: Any) -> str:
    """A stored layer's codec for the per-codec byte counters, e.g. ``rotated-k4v4``. A ring's
    newest slots count as recent where they wrap past its end too."""
    from kvplugin.cache.codec.rotating import QuantizedRotatingKVCache
    from kvplugin.cache.codec.state import STATE_CODEC, QuantizedArraysCache

    kbits = getattr(layer, "bits", None)
    if type(layer) is QuantizedArraysCache:
        return f"{STATE_CODEC}-{kbits}bit"
    sink, recent = getattr(layer, SINK_ATTR, 0), getattr(layer, RECENT_ATTR, 0)
    if type(layer) is QuantizedRotatingKVCache and hasattr(layer, SINK_ATTR):
        recent = sum(count for _, count in protected_ranges(layer)) - sink
    from kvplugin.cache.codec.prerope import KEY_ROPE_ATTR

    return CodecPlan(getattr(layer, CODEC_ATTR, "affine"), kbits,
                     getattr(layer, VALUE_BITS_ATTR, kbits), getattr(layer, "group_size", 0),
                     sink, recent, prerope_keys=hasattr(layer, KEY_ROPE_ATTR)).name


def dequantize_entry(cache: list, *, consume: bool = False, key_ropes: Any = None) -> list:
    """``QuantizedKVCache`` layers back to exact-size ``KVCache`` in their original dtype.

    Other layers are returned unchanged (same objects). An empty quantized layer becomes an
    empty ``KVCache``. The caller decides when to call this (e.g. only for entries it quantized:
    layers from mlx-lm's ``--kv-bits`` are ``QuantizedKVCache`` too). Each layer is evaluated
    as it is made; with ``consume`` it replaces the quantized layer in ``cache`` at once, so
    the transient is one layer rather than the whole quantized entry.

    Raises :class:`UnknownCodec` (before changing anything) when a layer records a codec this
    version does not know, or keys stored pre-RoPE whose rope ``key_ropes`` (the serving
    model's, one per layer) does not give: the caller treats the entry as a miss.

    With MLX on the CPU, plain layers of a rotated codec with 2-, 4- or 8-bit codes restore
    in numpy (:mod:`kvplugin.cache.codec.cpu_dequantize`, about twice as fast there); elsewhere MLX's
    kernels.
    """
    from kvplugin.cache.codec.prerope import check_rope
    from kvplugin.cache.codec.rotating import QuantizedRotatingKVCache, rotating_codec
    from kvplugin.cache.codec.state import QuantizedArraysCache, state_record

    known = (list(key_ropes) if key_ropes is not None and len(key_ropes) == len(cache)
             else [None] * len(cache))
    ropes: list = [None] * len(cache)
    for i, layer in enumerate(cache):
        if type(layer) is QuantizedKVCache:
            ropes[i] = check_rope(layer, _codec_of(layer)[0], known[i])
        elif type(layer) is QuantizedRotatingKVCache:
            ropes[i] = check_rope(layer, rotating_codec(layer)[0], known[i])
        elif type(layer) is QuantizedArraysCache:
            state_record(layer)
    out = cache if consume else list(cache)

    def one(item: tuple[int, Any]) -> tuple[int, Any]:
        return _dequantize_one(item, ropes[item[0]])

    for i, layer in in_lanes(enumerate(cache), one, _restored_arrays):
        out[i] = layer
    return out


def _restored_arrays(result: tuple[int, Any]) -> list:
    layer = result[1]
    state = getattr(layer, "cache", None)
    held = (getattr(layer, "keys", None), getattr(layer, "values", None),
            *(state if isinstance(state, list) else ()))
    return [x for x in held if isinstance(x, mx.array)]


def _dequantize_one(item: tuple[int, Any], rope: Any = None) -> tuple[int, Any]:
    """One layer of :func:`dequantize_entry` (left unevaluated: the caller evaluates);
    ``rope``: its keys' rope, checked against its record."""
    from kvplugin.cache.codec.rotating import QuantizedRotatingKVCache, dequantize_rotating
    from kvplugin.cache.codec.state import QuantizedArraysCache, dequantize_state

    i, layer = item
    if type(layer) is CacheList:
        children = dequantize_entry(list(layer.caches))
        changed = any(a is not b for a, b in zip(children, layer.caches))
        return i, with_children(layer, children) if changed else layer
    if type(layer) is QuantizedRotatingKVCache:
        return i, dequantize_rotating(layer, rope)
    if type(layer) is QuantizedArraysCache:
        return i, dequantize_state(layer)
    if type(layer) is not QuantizedKVCache:
        return i, layer
    kv = KVCache()
    if "step" in vars(layer):
        kv.step = layer.step
    codec, seed = _codec_of(layer)
    if layer.keys is not None and layer.offset > 0:
        from kvplugin.cache.codec.prerope import check_rope, plain_runs

        rope = check_rope(layer, codec, rope)
        kv.keys, kv.values = restore_rows(layer, codec, seed, layer.offset,
                                          _original_dtype(layer), rope,
                                          plain_runs(layer.offset))
        kv.offset = layer.offset
    return i, kv


@functools.cache
def warm_up(plan: Any) -> None:
    """Quantize and restore one small synthetic entry with ``plan`` (a
    :class:`kvplugin.codecs.CodecPlan`) in each dtype a model's cache may have, so that the
    kernels the codec uses are loaded now (see
    :meth:`kvplugin.cache.service.service.KVService.learn_model`); once per plan and
    process, as the kernels stay loaded."""
    rows = 2 * plan.group_size + plan.sink_tokens + plan.recent_tokens + 1
    ramp = mx.arange(rows * plan.group_size, dtype=mx.float32).reshape(1, 1, rows, -1)
    codecs = dict.fromkeys((plan.codec, plan.window_codec or plan.codec))  # both, in order
    for codec, dtype in itertools.product(codecs, (mx.float16, mx.bfloat16, mx.float32)):
        layer = KVCache()
        layer.update_and_fetch((ramp / rows).astype(dtype), (-ramp / rows).astype(dtype))
        stored = quantize_entry([layer], bits=plan.key_bits, value_bits=plan.value_bits,
                                group_size=plan.group_size, codec=codec,
                                sink_tokens=plan.sink_tokens, recent_tokens=plan.recent_tokens,
                                consume=True).cache
        restored = dequantize_entry(stored, consume=True)
        mx.eval(restored[0].keys, restored[0].values)
