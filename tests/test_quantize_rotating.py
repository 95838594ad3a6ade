"""Rotating layers (sliding windows, ``--max-kv-size``) are stored quantized and come back as
the same layer: class, slots in ring order, ``_idx``, ``offset``, ``keep``, ``max_size``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from kvplugin.cache.layers import entry_nbytes, layer_bits
from kvplugin.cache.layers.accounting import dense_nbytes
from kvplugin.codecs import RING_SLOTS_ATTR
from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
from kvplugin.cache.service.service import KVService
from kvplugin.cache.layers.trim import trim_entry
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings


def rotating(cls, n: int, max_size: int = 64, keep: int = 4):
    layer = cls(max_size, keep)
    for i in range(n):  # one token at a time: wraps in place past max_size
        k = mx.random.normal((1, 2, 1, 64), key=mx.random.key(i)).astype(mx.float16)
        layer.update_and_fetch(k, k * 0.5)
    mx.eval(layer.keys, layer.values)
    return layer


@pytest.mark.parametrize("cls", [RotatingKVCache, PreallocatedRotatingKVCache])
@pytest.mark.parametrize("n", [40, 150])  # before and after the ring wraps
def test_round_trip_gives_back_the_same_rotating_layer(cls, n):
    layer = trim_entry([rotating(cls, n)])[0]
    res = quantize_entry([layer], bits=8, group_size=64)
    assert res.quantized == 1 and layer_bits(res.cache[0]) == 8
    assert entry_nbytes(res.cache) < 0.6 * entry_nbytes([layer])
    (back,) = dequantize_entry(res.cache)
    assert type(back) is cls
    assert (back.offset, back._idx, back.keep, back.max_size) == (
        layer.offset, layer._idx, layer.keep, layer.max_size)
    assert back.keys.shape == layer.keys.shape and back.keys.dtype == layer.keys.dtype
    err = mx.abs(back.keys.astype(mx.float32) - layer.keys.astype(mx.float32)).max().item()
    assert err < 0.05
    # it keeps working as a cache: the next token goes where the original's would
    k = mx.ones((1, 2, 1, 64), dtype=mx.float16)
    a, _ = layer.update_and_fetch(k, k)
    b, _ = back.update_and_fetch(k, k)
    assert a.shape == b.shape and back.offset == layer.offset


def test_bounded_entries_are_stored_quantized_through_the_session():
    pm = create_plugin_manager(load_entry_points=False)
    svc = KVService(resolve_settings({"kv_cache_quantization": True, "max_kv_size": 64,
                                      "kv_cache_min_quantize_tokens": 0}),
                    host="test", hook=pm.hook, max_bytes=1 << 40)
    tokens = list(range(150))
    svc.fetch("m", tokens)
    assert svc.give_back("m", tokens, [rotating(PreallocatedRotatingKVCache, 150)])
    assert svc.stats()["entries_quantized"] == 1
    got, n = svc.fetch("m", tokens + [1])
    assert n == 150 and type(got[0]) is PreallocatedRotatingKVCache


def _outlier_window(n: int = 150) -> RotatingKVCache:
    """A wrapped window whose keys have two large channels, as real models' keys do."""
    layer = RotatingKVCache(64, 0)
    boost = mx.where(mx.arange(64) < 2, 12.0, 1.0)
    for i in range(n):
        k = mx.random.normal((1, 2, 1, 64), key=mx.random.key(i)) * boost
        layer.update_and_fetch(k.astype(mx.float16), (k * 0.5).astype(mx.float16))
    mx.eval(layer.keys, layer.values)
    return layer


def _rel_error(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten())).item()


def test_the_whole_codec_reaches_window_slots_and_loses_less_than_affine():
    """The entry's codec reaches its sliding-window layers too, recorded on the layer:
    rotated, keys per channel over the ring's slots."""
    from kvplugin.codecs import CODEC_ATTR

    layer = _outlier_window()
    errors = {}
    for codec in ("affine", "rotated", "rotated-channel"):
        (q,) = quantize_entry([layer], bits=4, group_size=64, codec=codec).cache
        assert getattr(q, CODEC_ATTR) == codec
        (back,) = dequantize_entry([q])
        assert (back._idx, back.offset, back.keys.dtype) == (layer._idx, layer.offset,
                                                               layer.keys.dtype)
        errors[codec] = _rel_error(back.keys, layer.keys)
    assert errors["rotated"] < 0.6 * errors["affine"], errors
    assert errors["rotated-channel"] < 0.6 * errors["affine"], errors


def test_a_window_layer_of_an_unknown_codec_is_never_read():
    from kvplugin.codecs import CODEC_ATTR, SEED_ATTR, UnknownCodec

    for attr, value in ((CODEC_ATTR, "from-a-newer-kvplugin"), (SEED_ATTR, "x")):
        (q,) = quantize_entry([_outlier_window(80)], bits=4, group_size=64,
                              codec="rotated").cache
        setattr(q, attr, value)
        with pytest.raises(UnknownCodec):
            dequantize_entry([q])


@pytest.mark.parametrize("codec", ["affine", "rotated-channel"])
@pytest.mark.parametrize("cls", [RotatingKVCache, PreallocatedRotatingKVCache])
def test_the_ssd_tier_writes_and_reads_back_a_quantized_rotating_entry_exactly(cls, codec,
                                                                             tmp_path):
    """Used to be refused by the tier (counted): a sliding-window entry stored quantized
    spills to SSD and comes back bit for bit, then restores to the same rotating layer."""
    from mlx_lm.models.cache import KVCache

    from kvplugin.cache.codec.rotating import QuantizedRotatingKVCache
    from kvplugin.cache.tiers.ssd import SSDTier

    full = KVCache()
    k = mx.random.normal((1, 2, 100, 64), key=mx.random.key(1)).astype(mx.float16)
    full.update_and_fetch(k, k * 2)
    entry = quantize_entry([rotating(cls, 100), full], bits=4, group_size=64,
                           codec=codec).cache
    assert type(entry[0]) is QuantizedRotatingKVCache and entry[0]._idx != entry[0].offset
    tier = SSDTier(tmp_path / "cold", max_bytes=1 << 30)
    tokens = list(range(100))
    assert tier.put("m", tokens, entry) is True and tier.stats()["refused"] == 0
    got, n = tier.fetch("m", tokens + [7])
    assert n == 100 and type(got[0]) is QuantizedRotatingKVCache
    for f in ("offset", "max_size", "keep", "_idx", "bits", "group_size", "dtype_name", "cls",
              "step", "kvplugin_codec", "kvplugin_codec_seed"):
        assert getattr(got[0], f) == getattr(entry[0], f), f
    for a, b in zip(got[0].keys + got[0].values, entry[0].keys + entry[0].values):
        assert a.dtype == b.dtype and mx.array_equal(a, b)
    back, want = dequantize_entry(got)[0], dequantize_entry(entry)[0]
    assert type(back) is cls and (back._idx, back.offset) == (want._idx, want.offset)
    assert mx.array_equal(back.keys, want.keys) and mx.array_equal(back.values, want.values)


def _numbered(cls, n: int, max_size: int = 64, keep: int = 4, prefill: int = 1):
    """A ring whose every key and value holds its token's position in channel 0 (and noise
    with per-channel offsets elsewhere): which slot holds which token can be read back."""
    layer = cls(max_size, keep)
    pos = 0
    while pos < n:
        step = prefill if pos == 0 else 1  # a multi-token prefill, then one token at a time
        noise = mx.random.normal((1, 2, step, 64), key=mx.random.key(pos))
        noise = noise + mx.arange(64, dtype=mx.float32) / 8  # channels with their own offset
        at = mx.arange(pos, pos + step, dtype=mx.float32).reshape(1, 1, step, 1)
        k = mx.concatenate([mx.broadcast_to(at, (1, 2, step, 1)), noise[..., 1:]], axis=-1)
        layer.update_and_fetch(k, k * -0.5)
        pos += step
    mx.eval(layer.keys, layer.values)
    return trim_entry([layer])[0]


def _positions(layer) -> list[int]:
    return [int(x) for x in layer.keys[0, 0, :, 0].tolist()]


@pytest.mark.parametrize("cls", [RotatingKVCache, PreallocatedRotatingKVCache])
@pytest.mark.parametrize("n,prefill,keep", [(40, 1, 4), (150, 1, 4), (150, 1, 0), (150, 100, 4),
                                            (64, 1, 4), (71, 1, 4)])
@pytest.mark.parametrize("codec,kbits,vbits", [("rotated-channel", 4, 4),
                                               ("rotated-channel-sym", 3, 3),
                                               ("rotated-channel", 8, 4), ("affine", 8, 8)])
def test_the_keep_and_the_newest_tokens_come_back_exactly_wherever_the_ring_holds_them(
        cls, n, prefill, keep, codec, kbits, vbits):
    """Before and after the ring wraps, with the newest tokens wrapping past the ring's end
    or not, after a multi-token prefill or one token at a time: the ``keep`` tokens (the
    first sink tokens while the ring is in order) and the newest 16 are stored at full
    precision and come back bit for bit; the layer comes back as the same class, slots,
    ``_idx``, ``offset``, ``keep`` and ``max_size``, and every other slot within the codec's
    error."""
    from kvplugin.cache.codec.quantize import codec_name

    layer = _numbered(cls, n, keep=keep, prefill=prefill)
    sink = 0 if codec == "affine" else 4
    recent = 0 if codec == "affine" else 16
    (q,) = quantize_entry([layer], bits=kbits, value_bits=vbits, group_size=64, codec=codec,
                          sink_tokens=sink, recent_tokens=recent).cache
    (back,) = dequantize_entry([q])
    assert type(back) is cls
    assert (back.offset, back._idx, back.keep, back.max_size, back.keys.shape) == (
        layer.offset, layer._idx, layer.keep, layer.max_size, layer.keys.shape)
    positions = _positions(layer)
    wrapped = layer.offset > len(positions)
    head = set(range(keep if wrapped else max(keep, sink))) if sink else set()
    want = head | set(range(layer.offset - recent, layer.offset))
    exact = {p for p, a, b in zip(positions, _slots(layer.keys), _slots(back.keys)) if a == b}
    exact_v = {p for p, a, b in zip(positions, _slots(layer.values), _slots(back.values))
               if a == b}
    assert want & set(positions) <= exact and want & set(positions) <= exact_v
    tol = {8: 0.02, 4: 0.15, 3: 0.3}
    assert _rel_error(back.keys, layer.keys) < tol[kbits]
    assert _rel_error(back.values, layer.values) < tol[vbits]
    # the protected slots are stored once, at full precision: the codes hold the others
    held = q.keys[-1].shape[-2] if sink else 0
    assert q.keys[0].shape[-2] == q.values[0].shape[-2] == len(positions) - held
    assert getattr(q, RING_SLOTS_ATTR, None) == (len(positions) if held else None)
    assert dense_nbytes(q) == layer.keys.nbytes + layer.values.nbytes
    name = codec_name(q)
    assert name.startswith(f"{codec}-k{kbits}v{vbits}")
    if recent:
        assert name.endswith(f"r{min(recent, len(positions) - len(head))}")


def _slots(x: mx.array) -> list:
    return [x[:, :, i, :].tolist() for i in range(x.shape[-2])]


def test_protected_slots_follow_the_ring_back_from_the_newest_and_wrap_past_its_end():
    from kvplugin.cache.codec.rotating import protected_slots

    # in order (never wrapped): the first sink tokens and the last recent ones
    assert protected_slots(40, 40, 4, 40, 4, 16) == [(0, 4), (24, 16)]
    assert protected_slots(40, 40, 0, 40, 4, 16) == [(0, 4), (24, 16)]
    # wrapped, newest at slot 29: slots 14..29; keep 0 has no head
    assert protected_slots(150, 64, 0, 30, 4, 16) == [(0, 0), (14, 16)]
    # wrapped, newest at slot 9 of a ring [4, 64): 4..9, then 54..63 past the end
    assert protected_slots(150, 64, 4, 10, 4, 16) == [(0, 4), (4, 6), (54, 10)]
    # a codec that protects no sinks protects no keep slots either
    assert protected_slots(150, 64, 4, 10, 0, 0) == [(0, 0), (10, 0)]


def test_per_channel_keys_over_a_ring_lose_less_than_per_token_groups():
    """Keys whose channels each have their own offset and spread (as real keys do): groups
    of slots per channel fit them better than per-token groups, whatever the ring's order."""
    layer = _numbered(RotatingKVCache, 300, keep=4)
    errors = {}
    for codec in ("rotated", "rotated-channel"):
        (back,) = dequantize_entry(quantize_entry([layer], bits=4, group_size=64, codec=codec,
                                                  sink_tokens=4, recent_tokens=16).cache)
        errors[codec] = _rel_error(back.keys, layer.keys)
    assert errors["rotated-channel"] < 0.8 * errors["rotated"], errors


@pytest.mark.parametrize("damage", ["codec", "seed", "value_bits", "protected", "scales",
                                    "boundary", "ring_slots", "ring_slots_type", "unprotected"])
def test_a_damaged_or_unknown_window_record_is_a_miss(damage):
    from kvplugin.cache.codec.rows import BOUNDARY_ATTR, RECENT_ATTR
    from kvplugin.codecs import CODEC_ATTR, SEED_ATTR, VALUE_BITS_ATTR, UnknownCodec

    (q,) = quantize_entry([_numbered(RotatingKVCache, 150)], bits=4, group_size=64,
                          codec="rotated-channel", sink_tokens=4, recent_tokens=16).cache
    dequantize_entry([q])  # as stored: read back
    if damage == "codec":
        setattr(q, CODEC_ATTR, "rotated-channel-v9")
    elif damage == "seed":
        setattr(q, SEED_ATTR, 1.5)
    elif damage == "value_bits":
        setattr(q, VALUE_BITS_ATTR, 7)
    elif damage == "protected":
        setattr(q, RECENT_ATTR, getattr(q, RECENT_ATTR) + 1)
    elif damage == "scales":
        more = [mx.concatenate([x, x], axis=-2) for x in q.keys[1:3]]  # a group too many
        q.keys = (q.keys[0], *more, q.keys[3])
    elif damage == "ring_slots":  # codes and protected slots no longer add up to the ring
        setattr(q, RING_SLOTS_ATTR, getattr(q, RING_SLOTS_ATTR) + 1)
    elif damage == "ring_slots_type":
        setattr(q, RING_SLOTS_ATTR, "64")
    elif damage == "unprotected":  # the slots the codes leave, with nothing to fill them
        q.keys, q.values = q.keys[:3], q.values[:3]
        for name in (RECENT_ATTR, "kvplugin_sink_tokens", "kvplugin_recent_start"):
            delattr(q, name)
    else:
        setattr(q, BOUNDARY_ATTR, "60:9")
    with pytest.raises(UnknownCodec):
        dequantize_entry([q])


@pytest.mark.parametrize("n", [40, 150])
def test_a_ring_stored_with_its_protected_slots_among_the_codes_still_restores(n):
    """The layout of kvplugin before 2026-12-07 (every slot among the codes, the protected
    ones also at full precision, no slot count recorded), on SSD or in Redis after an
    upgrade: restored as it was stored, the protected slots exact."""
    from kvplugin.cache.codec.rows import encode_rows

    layer = _numbered(RotatingKVCache, n)
    (q,) = quantize_entry([layer], bits=4, group_size=64, codec="rotated-channel",
                          sink_tokens=4, recent_tokens=16).cache
    (new,) = dequantize_entry([q])
    codes = encode_rows(layer.keys, layer.values, "rotated-channel", 4, 4, 64, None)
    q.keys, q.values = codes[0] + q.keys[3:], codes[1] + q.values[3:]
    delattr(q, RING_SLOTS_ATTR)
    (old,) = dequantize_entry([q])
    assert old.keys.shape == new.keys.shape == layer.keys.shape
    assert (old.offset, old._idx) == (layer.offset, layer._idx)
    assert _rel_error(old.keys, layer.keys) < 0.15 and _rel_error(old.values, layer.values) < 0.15
    assert mx.array_equal(old.keys[..., :4, :], layer.keys[..., :4, :])
    newest = layer._idx
    assert mx.array_equal(old.values[..., newest - 8 : newest, :],
                          layer.values[..., newest - 8 : newest, :])


def test_storing_a_ring_s_protected_slots_once_saves_their_codes():
    """A 64-slot ring at 4 bits with 20 protected slots: the codes of 44 slots, not 64."""
    layer = _numbered(RotatingKVCache, 150)
    (q,) = quantize_entry([layer], bits=4, group_size=64, codec="rotated-channel",
                          sink_tokens=4, recent_tokens=16).cache
    protected = 20 * (layer.keys.nbytes + layer.values.nbytes) // 64
    heads, width, size = layer.values.shape[1], layer.values.shape[-1], layer.keys.itemsize
    value_codes = 44 * heads * (width // 2 + 2 * size)  # 4-bit codes, a scale and a minimum
    key_codes = 44 * heads * width // 2 + 2 * heads * width * size  # one group per channel
    assert q.nbytes == protected + value_codes + key_codes


@pytest.mark.parametrize("cls", [RotatingKVCache, PreallocatedRotatingKVCache])
@pytest.mark.parametrize("codec", ["affine", "rotated-channel"])
def test_an_unwrapped_quantized_ring_is_cut_like_stock_trims_it_and_a_wrapped_one_never(codec,
                                                                                      cls):
    """Another conversation sharing a prefix of a stored window entry (a system prompt) gets
    the entry cut there, as stock's trim gives it: restored whole, then trimmed; the donor
    stays as stored. A wrapped ring no longer holds its first tokens: never cut."""
    from kvplugin.cache.layers import can_copy_prefix, copy_prefix

    layer = trim_entry([rotating(cls, 50)])[0]  # a 64-slot window, not wrapped
    stored = quantize_entry([layer], bits=4, group_size=64, codec=codec, sink_tokens=4,
                            recent_tokens=16).cache
    (whole,) = dequantize_entry(list(stored))
    assert can_copy_prefix(stored, 30) and not can_copy_prefix(stored, 51)
    cut = copy_prefix(stored, 30, share=True)
    (back,) = dequantize_entry(cut)
    assert type(back) is cls and (back.offset, back._idx) == (30, 30)
    k = mx.ones((1, 2, 3, 64), dtype=mx.float16)  # the next prompt's tokens: what stock sees
    want, _ = copy_prefix([whole], 30)[0].update_and_fetch(k, k)
    got, _ = back.update_and_fetch(k, k)
    assert got.shape == want.shape == (1, 2, 33, 64)
    assert mx.array_equal(got, want).item()
    (again,) = dequantize_entry(stored)  # the donor is untouched: still 50 tokens
    assert again.offset == 50
    for n in (64, 150):  # full (as stock: not trimmable), and wrapped
        ring = quantize_entry([trim_entry([rotating(cls, n)])[0]], bits=4, group_size=64,
                              codec=codec).cache
        assert not can_copy_prefix(ring, 30) and copy_prefix(ring, 30) is None
