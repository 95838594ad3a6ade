"""Recurrent state stored rotated at 8 bits (kvplugin.cache.codec.state): the same class
and arrays come back in their dtypes within 8-bit error, nested (Falcon-H1) state too; the
entry is smaller; the SSD tier carries it; a damaged or unknown record is a miss."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from kvplugin.cache.layers import entry_nbytes
from kvplugin.cache.codec.quantize import codec_name, dequantize_entry, quantize_entry
from kvplugin.cache.codec.state import QuantizedArraysCache
from kvplugin.codecs import UnknownCodec


def _state(dtype=mx.float32) -> ArraysCache:
    """A GatedDeltaNet-like layer: a conv state (B, K-1, C) and a recurrent state whose rows
    have a few large values."""
    layer = ArraysCache(2)
    conv = mx.random.normal((1, 3, 256), key=mx.random.key(1))
    big = mx.where(mx.arange(64) % 16 == 3, 15.0, 1.0)
    rec = mx.random.normal((1, 2, 64, 64), key=mx.random.key(2)) * big
    layer.cache = [conv.astype(dtype), rec.astype(dtype)]
    mx.eval(layer.cache)
    return layer


def _err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(mx.sum((a - b) ** 2)) / mx.sqrt(mx.sum(b**2)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_state_round_trip_gives_back_the_same_layer_smaller(dtype):
    src = _state(dtype)
    kv = KVCache()
    k = mx.random.normal((1, 1, 300, 64), key=mx.random.key(3)).astype(dtype)
    kv.update_and_fetch(k, k)
    entry = [src, kv]
    res = quantize_entry(entry, bits=8, group_size=64, quantize_state=True)
    assert res.quantized == 2 and type(res.cache[0]) is QuantizedArraysCache
    assert codec_name(res.cache[0]) == "rotated-state-8bit"
    assert entry_nbytes(res.cache) < entry_nbytes(entry) / 1.8
    back = dequantize_entry(res.cache)[0]
    assert type(back) is ArraysCache and len(back.cache) == 2
    for got, want in zip(back.cache, src.cache):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _err(got, want) < 0.01
    # off: recurrent state stays as it was (the same object)
    kept = quantize_entry(entry, bits=8, group_size=64).cache
    assert kept[0] is src


def test_rotation_spreads_the_state_rows_large_values():
    """Rotated groups lose less than plain 8-bit groups on rows with a few large values."""
    src = _state()
    rec = src.cache[1]
    plain = mx.dequantize(*mx.quantize(rec, group_size=64, bits=8), group_size=64, bits=8)
    back = dequantize_entry(quantize_entry([src], bits=8, group_size=64,
                                           quantize_state=True).cache)[0]
    assert _err(back.cache[1], rec) < 0.8 * _err(plain, rec)


def test_nested_state_and_the_ssd_tier(tmp_path):
    from kvplugin.cache.tiers.ssd import SSDTier

    kv = KVCache()
    k = mx.random.normal((1, 1, 300, 64), key=mx.random.key(4)).astype(mx.float16)
    kv.update_and_fetch(k, k)
    nested = CacheList(_state(), kv)
    stored = quantize_entry([nested], bits=8, group_size=64, quantize_state=True).cache
    assert type(stored[0].caches[0]) is QuantizedArraysCache
    tier = SSDTier(tmp_path / "kv", max_bytes=1 << 30)
    tokens = list(range(300))
    assert tier.put("m", tokens, stored) and tier.stats()["refused"] == 0
    got, n = tier.fetch("m", tokens + [1])
    assert n == 300 and type(got[0].caches[0]) is QuantizedArraysCache
    back = dequantize_entry(got)[0].caches[0]
    want = dequantize_entry(stored)[0].caches[0]
    assert type(back) is ArraysCache
    assert all(mx.array_equal(a, b) for a, b in zip(back.cache, want.cache))


@pytest.mark.parametrize("damage", ["codec", "bits", "groups", "dtype", "arrays"])
def test_a_damaged_or_unknown_state_record_is_a_miss(damage):
    from kvplugin.codecs import CODEC_ATTR

    (q,) = quantize_entry([_state()], bits=8, group_size=64, quantize_state=True).cache
    if damage == "codec":
        setattr(q, CODEC_ATTR, "rotated-state-v2")
    elif damage == "bits":
        q.bits = 4
    elif damage == "groups":
        q.kvplugin_state_groups = "64"
    elif damage == "dtype":
        q.kvplugin_state_dtypes = "float32,float64x"
    else:
        q.cache = [q.cache[0][:2], q.cache[1]]
    with pytest.raises(UnknownCodec):
        dequantize_entry([q])


def test_the_setting_turns_it_off_and_names_flag_and_env():
    from kvplugin.codecs import codec_plan
    from kvplugin.settings import option_info, resolve_settings

    assert codec_plan(resolve_settings({"kv_cache_quantization": True})).quantize_state
    off = resolve_settings({"kv_cache_quantization": True, "kv_cache_quantize_state": "off"})
    assert not codec_plan(off).quantize_state
    info = option_info("kv_cache_quantize_state")
    assert (info.flag, info.env) == ("--kv-cache-quantize-state",
                                     "KVPLUGIN_KV_CACHE_QUANTIZE_STATE")


def test_a_narrow_last_axis_is_regrouped_not_left_at_full_precision():
    """Mamba's SSM state is (B, d_inner, d_state=16): no group divides 16, so its last two
    axes are quantized as rows of 64 and come back in their own shape."""
    layer = ArraysCache(2)
    layer.cache = [mx.random.normal((1, 3, 128), key=mx.random.key(5)),
                   mx.random.normal((1, 128, 16), key=mx.random.key(6))]
    (q,) = quantize_entry([layer], bits=8, group_size=64, quantize_state=True).cache
    assert all(isinstance(p, tuple) for p in q.cache)
    assert entry_nbytes([q]) < entry_nbytes([layer]) / 3  # fp32 state at 8 bits
    back = dequantize_entry([q])[0]
    for got, want in zip(back.cache, layer.cache):
        assert got.shape == want.shape and _err(got, want) < 0.01
