"""Codecs of stored entries: rotated (seeded Hadamard), keys per channel (rotated-channel),
K/V-asymmetric bits, protected sink/recent tokens; the codec recorded on the layer, round-tripped through the SSD tier, and
an unknown codec being a miss."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvplugin.cache.codec import rotation
from kvplugin.cache.layers import entry_nbytes
from kvplugin.cache.codec.quantize import (
    CODEC_ATTR,
    SEED_ATTR,
    UnknownCodec,
    VALUE_BITS_ATTR,
    codec_name,
    dequantize_entry,
    quantize_entry,
)
from kvplugin.cache.tiers.serialize import deserialize_cache, serialize_cache
from kvplugin.cache.tiers.ssd import SSDTier

H, D, N = 2, 64, 300


def _layer(seed: int = 0, n: int = N, outliers: bool = True) -> KVCache:
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
    if outliers:  # real keys have a few large channels: what rotation is for
        k = k * mx.array(np.where(np.arange(D) % 16 == 3, 20.0, 1.0).astype(np.float32))
    v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1))
    c = KVCache()
    c.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
    mx.eval(c.keys, c.values)
    return c


def _err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(mx.sum((a - b) ** 2)) / mx.sqrt(mx.sum(b**2)))


def test_rotation_is_orthogonal_seeded_and_needs_power_of_two():
    r = np.array(rotation.rotation(64, 1))
    assert np.allclose(r @ r.T, np.eye(64), atol=1e-5)
    assert not np.allclose(r, np.array(rotation.rotation(64, 2)))
    x = mx.random.normal((3, 64), key=mx.random.key(3))
    assert _err(rotation.unrotate(rotation.rotate(x, 5), 5), x) < 1e-5
    with pytest.raises(ValueError, match="power-of-two"):
        rotation.rotation(96)


@pytest.mark.parametrize("codec", ["affine", "rotated", "rotated-channel", "rotated-channel-sym"])
@pytest.mark.parametrize("kbits,vbits", [(8, 8), (4, 4), (8, 4), (5, 4), (3, 4)])
def test_round_trip_records_codec_and_restores_dtype(codec, kbits, vbits):
    src = _layer()
    res = quantize_entry([src], bits=kbits, value_bits=vbits, group_size=64, codec=codec)
    q = res.cache[0]
    assert type(q) is QuantizedKVCache and getattr(q, CODEC_ATTR) == codec
    assert q.bits == kbits and getattr(q, VALUE_BITS_ATTR, kbits) == vbits
    assert codec_name(q) == f"{codec}-k{kbits}v{vbits}"
    back = dequantize_entry(res.cache)[0]
    assert type(back) is KVCache and back.keys.dtype == mx.float16 and back.offset == N
    tol = {8: 0.02, 5: 0.08, 4: 0.2, 3: 0.4}
    key_tol = tol[kbits] * (2 if codec == "affine" else 1)  # outlier channels cost affine
    assert _err(back.keys, src.keys[..., :N, :]) < key_tol
    assert _err(back.values, src.values[..., :N, :]) < tol[vbits]


def test_rotation_lowers_key_error_on_outlier_channels():
    src = _layer()
    errs = {}
    for codec in ("affine", "rotated"):
        back = dequantize_entry(quantize_entry([src], bits=4, group_size=64, codec=codec).cache)
        errs[codec] = _err(back[0].keys, src.keys[..., :N, :])
    assert errs["rotated"] < 0.6 * errs["affine"], errs


def test_asymmetric_bits_store_fewer_bytes():
    sizes = {
        (k, v): entry_nbytes(quantize_entry([_layer()], bits=k, value_bits=v, group_size=64).cache)
        for k, v in [(8, 8), (8, 4), (4, 4)]
    }
    assert sizes[(8, 8)] > sizes[(8, 4)] > sizes[(4, 4)]


def test_protected_tokens_come_back_exact_and_survive_a_trim():
    src = _layer()
    res = quantize_entry([src], bits=4, group_size=64, codec="rotated", sink_tokens=4,
                         recent_tokens=32)
    q = res.cache[0]
    assert codec_name(q) == "rotated-k4v4-s4r32" and len(q.keys) == 4
    back = dequantize_entry([q])[0]
    k0 = src.keys[..., :N, :]
    assert mx.array_equal(back.keys[..., :4, :], k0[..., :4, :])
    assert mx.array_equal(back.keys[..., N - 32 :, :], k0[..., N - 32 :, :])
    assert not mx.array_equal(back.keys[..., 4:N - 32, :], k0[..., 4:N - 32, :])
    # a shorter prefix of the stored entry (the store trims to the reused length)
    q.offset = N - 10
    short = dequantize_entry([q])[0]
    assert short.offset == N - 10
    assert mx.array_equal(short.keys[..., N - 32 : N - 10, :], k0[..., N - 32 : N - 10, :])
    assert mx.array_equal(short.values[..., :4, :], src.values[..., :4, :])


def test_rotated_falls_back_to_affine_for_non_power_of_two_width():
    c = KVCache()
    k = mx.random.normal((1, H, N, 96)).astype(mx.float16)
    c.update_and_fetch(k, k)
    q = quantize_entry([c], bits=4, group_size=32, codec="rotated").cache[0]
    assert getattr(q, CODEC_ATTR) == "affine" and not hasattr(q, SEED_ATTR)


@pytest.mark.parametrize("codec", ["rotated", "rotated-channel", "rotated-channel-sym"])
def test_codec_metadata_round_trips_through_serialize(codec):
    q = quantize_entry([_layer()], bits=5, value_bits=4, group_size=64, codec=codec,
                       sink_tokens=4, recent_tokens=16).cache
    arrays, layers = serialize_cache(q)
    back = deserialize_cache(arrays, layers)
    for a in (CODEC_ATTR, SEED_ATTR, VALUE_BITS_ATTR):
        assert getattr(back[0], a) == getattr(q[0], a)
    want, got = dequantize_entry(q), dequantize_entry(back)
    assert mx.array_equal(want[0].keys, got[0].keys)
    assert mx.array_equal(want[0].values, got[0].values)


def _stored(tmp_path, codec_value):
    """An entry through a real SSD tier, its recorded codec set to ``codec_value``."""
    tier = SSDTier(tmp_path / "ssd", max_bytes=1 << 30)
    q = quantize_entry([_layer()], bits=4, group_size=64, codec="rotated").cache
    setattr(q[0], CODEC_ATTR, codec_value)
    tokens = list(range(N))
    assert tier.put("m", tokens, q)
    got = tier.fetch("m", tokens + [7])
    assert got is not None
    return got[0]


def test_ssd_tier_round_trips_codec(tmp_path):
    cache = _stored(tmp_path, "rotated")
    assert getattr(cache[0], CODEC_ATTR) == "rotated"
    back = dequantize_entry(cache)
    assert _err(back[0].keys, _layer().keys[..., :N, :]) < 0.15


def test_unknown_codec_is_refused_not_misread(tmp_path):
    cache = _stored(tmp_path, "turboquant-v9")
    with pytest.raises(UnknownCodec, match="turboquant-v9"):
        dequantize_entry(cache)
    assert type(cache[0]) is QuantizedKVCache  # nothing changed


def _service(**flags):
    from kvplugin import plugins
    from kvplugin.cache.service.service import KVService
    from kvplugin.settings import resolve_settings

    pm = plugins.create_plugin_manager(load_entry_points=False)
    return KVService(resolve_settings(flags), host="test", hook=pm.hook, max_bytes=1 << 40)


@pytest.mark.parametrize("unknown", [False, True])
def test_session_hits_known_codec_and_misses_unknown(unknown):
    s = _service(kv_cache_quantization_bits=4, kv_cache_codec="rotated",
                 kv_cache_value_bits=8, kv_cache_min_quantize_tokens=0)
    tokens = list(range(N))
    assert s.insert("m", tokens, [_layer()])
    stats = s.stats()
    # the rotated codecs keep 4 sink + 16 recent tokens unless told otherwise
    assert stats["bytes_stored_by_codec"] == {"rotated-k4v8-s4r16": stats["bytes_stored"]}
    assert stats["quantization"]["codec"] == "rotated"
    assert stats["quantization"]["value_bits"] == 8
    if unknown:
        [entry] = s.store.entries()
        setattr(entry.cache[0], CODEC_ATTR, "from-a-newer-kvplugin")
    cache, n = s.fetch("m", tokens + [1])
    if unknown:
        assert cache is None and n == 0
    else:
        assert n == N and type(cache[0]) is KVCache
        assert _err(cache[0].keys, _layer().keys[..., :N, :]) < 0.15


def test_bench_codec_specs_parse_and_reject_garbage():
    from kvplugin.tools.bench.codec_quality import CANDIDATE_CODECS, parse_codec

    assert parse_codec("rotated-k4v3-g64-s4r32") == dict(
        codec="rotated", bits=4, value_bits=3, group_size=64, sink_tokens=4, recent_tokens=32,
        ranked_key_bits=None)
    assert parse_codec("rotated-channel-k4v4-g64-s4r16-kr6+prerope")["ranked_key_bits"] == 6
    assert parse_codec("rotated-channel-k4v4-g64-s4r0")["codec"] == "rotated-channel"
    assert parse_codec("rotated-channel-sym-k3v3-g64-s4r6")["codec"] == "rotated-channel-sym"
    assert {parse_codec(s)["codec"] for s in CANDIDATE_CODECS} == {
        "affine", "rotated", "rotated-channel", "rotated-channel-sym"}
    with pytest.raises(ValueError, match="CODEC-kKvV"):
        parse_codec("turbo-k4")


@pytest.mark.parametrize("field,value,env", [
    ("kv_cache_codec", "turbo", "KVPLUGIN_KV_CACHE_CODEC"),
    ("kv_cache_key_bits", 7, "KVPLUGIN_KV_CACHE_KEY_BITS"),
    ("kv_cache_value_bits", 1, "KVPLUGIN_KV_CACHE_VALUE_BITS"),
    ("kv_cache_sink_tokens", -1, "KVPLUGIN_KV_CACHE_SINK_TOKENS"),
])
def test_bad_codec_options_name_flag_and_env(field, value, env):
    from kvplugin.settings import SettingsError, resolve_settings

    flag = "--" + field.replace("_", "-")
    with pytest.raises(SettingsError, match=f"{flag} / {env}"):
        resolve_settings({field: value})


def _channel_skewed_layer(n: int = N) -> KVCache:
    """Keys like a real model's: each channel has its own offset and range, tokens vary
    little within a channel (what per-channel groups are for)."""
    rng = np.random.default_rng(7)
    offsets = rng.normal(0, 4, D).astype(np.float32)
    ranges = np.exp(rng.normal(0, 1, D)).astype(np.float32)
    k = mx.array(offsets) + mx.array(ranges) * mx.random.normal((1, H, n, D), key=mx.random.key(5))
    v = mx.random.normal((1, H, n, D), key=mx.random.key(6))
    c = KVCache()
    c.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
    mx.eval(c.keys, c.values)
    return c


def test_keys_per_channel_lose_less_than_per_token_on_channel_structure():
    src = _channel_skewed_layer()
    errs = {}
    for codec in ("rotated", "rotated-channel"):
        back = dequantize_entry(quantize_entry([src], bits=4, group_size=64, codec=codec).cache)
        errs[codec] = _err(back[0].keys, src.keys[..., :N, :])
    assert errs["rotated-channel"] < 0.6 * errs["rotated"], errs


def test_channel_keys_cut_inside_a_group_keep_the_prefix_exactly(tmp_path):
    """Trim, prefix copies and the SSD tier cut every array to its first rows; a cut inside a
    group of 64 tokens must give the same first tokens as the whole entry."""
    from kvplugin.cache.layers import copy_prefix, trim_layer

    q = quantize_entry([_channel_skewed_layer()], bits=4, group_size=64,
                       codec="rotated-channel", sink_tokens=4, recent_tokens=16).cache
    assert codec_name(q[0]) == "rotated-channel-k4v4-s4r16"
    assert q[0].keys[1].shape[-2] == 5  # ceil(300 / 64) rows of scales, one row per token
    whole = dequantize_entry(q)[0]
    for m in (130, 64, 3):
        cut = copy_prefix(q, m)
        assert cut is not None
        got = dequantize_entry(cut)[0]
        assert got.offset == m and mx.array_equal(got.keys, whole.keys[..., :m, :])
        assert mx.array_equal(got.values, whole.values[..., :m, :])
    q[0].offset = 130  # what the store does before trimming a reused entry shorter
    trimmed = trim_layer(q[0])
    assert trimmed.keys[0].shape[-2] == 130
    tier = SSDTier(tmp_path / "ssd", max_bytes=1 << 30)
    tokens = list(range(130))
    assert tier.put("m", tokens, [trimmed])
    back = dequantize_entry(tier.fetch("m", tokens + [1])[0])[0]
    assert mx.array_equal(back.keys, whole.keys[..., :130, :])


def test_channel_keys_with_a_damaged_record_are_a_miss():
    q = quantize_entry([_layer()], bits=4, group_size=64, codec="rotated-channel").cache
    q[0].keys = (q[0].keys[0], q[0].keys[1][..., :2, :], q[0].keys[2][..., :2, :])
    with pytest.raises(UnknownCodec, match="per-channel"):
        dequantize_entry(q)


def test_only_plain_affine_layers_are_handed_to_a_quantized_host_as_they_are():
    """mlx-lm ``--kv-bits`` attends over ``QuantizedKVCache`` itself: a rotated or per-channel
    layer of the same bits would be read as affine, so only plain affine ones match."""
    from kvplugin.cache.codec.quantize import matches_live

    for codec, sink, want in (("affine", 0, True), ("affine", 4, False), ("rotated", 0, False),
                              ("rotated-channel", 0, False)):
        q = quantize_entry([_layer()], bits=4, group_size=64, codec=codec,
                           sink_tokens=sink).cache[0]
        assert matches_live(q, 4, 64, 0) is want, codec
    asym = quantize_entry([_layer()], bits=4, value_bits=8, group_size=64).cache[0]
    assert not matches_live(asym, 4, 64, 0)


@pytest.mark.parametrize("flags,want", [
    ({}, "affine-k8v8"),  # the default: 8-bit entries are already near lossless
    ({"kv_cache_quantization_bits": 4}, "rotated-channel-k4v4-s4r16"),
    ({"kv_cache_quantization_bits": 3}, "rotated-channel-sym-k3v3-s4r6"),  # values scale-only
    ({"kv_cache_quantization_bits": 3, "kv_cache_recent_tokens": 0},
     "rotated-channel-sym-k3v3-s4r0"),
    ({"kv_cache_key_bits": 4, "kv_cache_value_bits": 3}, "rotated-channel-k4v3-s4r16"),
    ({"kv_cache_quantization_bits": 3, "kv_cache_codec": "rotated-channel"},
     "rotated-channel-k3v3-s4r16"),
    ({"kv_cache_key_bits": 8, "kv_cache_value_bits": 4}, "affine-k8v4"),
    ({"kv_cache_key_bits": 8, "kv_cache_value_bits": 4, "kv_cache_codec": "rotated-channel"},
     "rotated-channel-k8v4-s4r16"),  # protected: the values are below 6 bits
    ({"kv_cache_quantization_bits": 4, "kv_cache_codec": "affine"}, "affine-k4v4"),
    ({"kv_cache_codec": "rotated-channel"}, "rotated-channel-k8v8"),  # no protected tokens
    ({"kv_cache_codec": "rotated", "kv_cache_recent_tokens": 8}, "rotated-k8v8-s0r8"),
    ({"kv_cache_codec": "rotated", "kv_cache_quantization_bits": 4, "kv_cache_sink_tokens": 0},
     "rotated-k4v4-s0r16"),
])
def test_auto_codec_resolves_from_the_bits_and_reaches_the_stored_layers(flags, want):
    """What ``--kv-cache-codec auto`` means is decided once (kvplugin.codecs) and is what the
    default quantize hook stores: the stored layers are named exactly so."""
    s = _service(kv_cache_min_quantize_tokens=0, **flags)
    assert s.insert("m", list(range(N)), [_layer()])
    stats = s.stats()
    assert list(stats["bytes_stored_by_codec"]) == [want]
    assert want.startswith(stats["quantization"]["codec"] + "-k")
    assert stats["quantization"]["codec_setting"] == flags.get("kv_cache_codec", "auto")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_channel_packing_round_trips_every_width(bits):
    """Per-channel codes are packed by kvplugin itself; for 2/4/8 bits in mx.quantize's own
    layout (mx.dequantize with unit scales reads them back)."""
    from kvplugin.cache.codec.channel import pack_codes as _pack, unpack_codes as _unpack

    codes = mx.random.randint(0, 1 << bits, (2, 3, 70, 64), key=mx.random.key(bits))
    words = _pack(codes, bits)
    assert words.dtype == mx.uint32 and words.shape[-1] == 64 * bits // 32
    assert mx.array_equal(_unpack(words, bits), codes.astype(mx.uint32))
    if 32 % bits == 0:
        ones = mx.ones((2, 3, 70, 1))
        read = mx.dequantize(words, ones, ones * 0, group_size=64, bits=bits)
        assert mx.array_equal(read.astype(mx.uint32), codes.astype(mx.uint32))


def _prefix_layer(layer: KVCache, m: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(layer.keys[..., :m, :], layer.values[..., :m, :])
    mx.eval(c.keys, c.values)
    return c


def _arrays(entry: list) -> list:
    return [x for layer in entry for x in (*layer.keys, *layer.values)]


@pytest.mark.parametrize("codec,bits,sink,recent", [
    ("affine", 8, 0, 0), ("rotated", 4, 4, 16), ("rotated-channel", 4, 4, 16),
    ("rotated-channel-sym", 3, 4, 6)])
def test_a_stored_prefix_gives_its_rows_and_the_entry_is_what_quantizing_it_whole_gives(
        codec, bits, sink, recent):
    """Reusing a stored prefix's rows is only a shortcut: the stored arrays equal those of
    quantizing the whole entry afresh (same rows, same per-channel groups; 150 tokens cut
    the second 64-token key group), and its dequantized values too."""
    whole = [_layer(seed) for seed in (0, 7)]
    kw = dict(bits=bits, group_size=64, codec=codec, sink_tokens=sink, recent_tokens=recent)
    stored = quantize_entry([_prefix_layer(c, 150) for c in whole], **kw).cache
    afresh = quantize_entry(whole, **kw).cache
    reused = quantize_entry(whole, stored_prefix=stored, **kw).cache
    assert [x.shape for x in _arrays(reused)] == [x.shape for x in _arrays(afresh)]
    for a, b in zip(_arrays(reused), _arrays(afresh)):
        assert mx.array_equal(a, b).item()
    for a, b in zip(dequantize_entry(reused), dequantize_entry(afresh)):
        assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()


def test_only_the_new_rows_are_quantized_when_a_stored_prefix_holds_the_rest(monkeypatch):
    """The codec's work follows the tokens a turn adds: with 290 of 300 rows stored, only
    the values' 10 new rows and the keys' last, unfinished group of 64 are rotated; a prefix
    stored with another codec (or bits) is not reused."""
    rotated: list[int] = []
    real = rotation.rotate
    monkeypatch.setattr(rotation, "rotate", lambda x, *a: rotated.append(x.shape[-2]) or real(x, *a))
    whole = [_layer(3)]
    kw = dict(bits=4, group_size=64, codec="rotated-channel", sink_tokens=4, recent_tokens=16,
              chunk_bytes=0)  # one pass per array (a one-layer entry would be chunked)
    stored = quantize_entry([_prefix_layer(whole[0], 290)], **kw).cache
    rotated.clear()
    quantize_entry(whole, stored_prefix=stored, **kw)
    assert rotated == [300 - 256, 10]  # keys from the group that holds row 290 on, values
    rotated.clear()
    other = quantize_entry([_prefix_layer(whole[0], 290)], **{**kw, "bits": 8}).cache
    rotated.clear()
    quantize_entry(whole, stored_prefix=other, **kw)
    assert rotated == [300, 300]
