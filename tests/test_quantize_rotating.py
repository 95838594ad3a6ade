"""Rotating layers (sliding windows, ``--max-kv-size``) are stored quantized and come back as
the same layer: class, slots in ring order, ``_idx``, ``offset``, ``keep``, ``max_size``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from kvplugin.cache.layers import entry_nbytes, layer_bits
from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.quantize import dequantize_entry, quantize_entry
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


def test_a_rotated_codec_rotates_window_slots_and_loses_less_than_affine():
    """The entry's codec reaches its sliding-window layers too (rotated, per token: a ring is
    not in token order), recorded on the layer, and spreads the large channels."""
    from kvplugin.codecs import CODEC_ATTR

    layer = _outlier_window()
    errors = {}
    for codec in ("affine", "rotated-channel"):
        (q,) = quantize_entry([layer], bits=4, group_size=64, codec=codec).cache
        assert getattr(q, CODEC_ATTR) == ("affine" if codec == "affine" else "rotated")
        (back,) = dequantize_entry([q])
        assert (back._idx, back.offset, back.keys.dtype) == (layer._idx, layer.offset,
                                                               layer.keys.dtype)
        errors[codec] = _rel_error(back.keys, layer.keys)
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

    from kvplugin.cache.quantize_rotating import QuantizedRotatingKVCache
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
