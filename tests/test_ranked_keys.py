"""Key bits by layer (the 4-bit default in entries with a window): the layer in ten whose keys
the codec quantizes worst takes 6-bit keys, paid for by a bit fewer on the best-quantized
ones, never more bytes than the uniform bits. Through the real service and default hook."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
from kvplugin.cache.codec.ranked import ranked_bits
from kvplugin.cache.layers import entry_nbytes
from kvplugin.codecs import RANKED_KEYS, codec_plan
from kvplugin.settings import resolve_settings
from kvcaches import stored_after_insert

N, SLOTS, WIDTH = 700, 256, 64


def _kv(seed: int, scale: float) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, 2, N, WIDTH), key=mx.random.key(seed)) * scale
    v = mx.random.normal((1, 2, N, WIDTH), key=mx.random.key(seed + 1))
    return k.astype(mx.float16), v.astype(mx.float16)


def _ring(seed: int, scale: float = 1.0) -> RotatingKVCache:
    c = RotatingKVCache(max_size=SLOTS, keep=4)
    k, v = _kv(seed, scale)
    c.update_and_fetch(k[..., :500, :], v[..., :500, :])
    for i in range(500, N):  # decoding, one token at a time: the ring wraps
        c.update_and_fetch(k[..., i:i + 1, :], v[..., i:i + 1, :])
    return c


def _plain(seed: int, scale: float = 1.0) -> KVCache:
    c = KVCache()
    c.update_and_fetch(*_kv(seed, scale))
    return c


def _entry(wide: int, layers: int = 12) -> list:
    entry = [_ring(i, 3.0 if i == wide else 1.0) for i in range(layers)]  # widest ranges
    mx.eval([c.state for c in entry])
    return entry


def _bits(entry: list) -> list[int]:
    return [layer.bits for layer in entry]


def test_ranked_bits_raise_the_widest_and_pay_with_the_narrowest():
    spreads = {i: float(s) for i, s in enumerate([5, 1, 9, 2, 3, 4, 6, 7, 8, 0.5, 2.5])}
    out = ranked_bits(spreads, dict.fromkeys(spreads, 4), dict.fromkeys(spreads, 10), 6)
    assert out[2] == 6 and out[9] == 3 and out[1] == 3  # 2 raised (11 layers), widest: 2, 8
    assert out[8] == 6 and out[3] == 3 and out[10] == 3
    assert sum(b * 10 for b in out.values()) == 4 * 10 * len(spreads)  # the same bytes
    # a raised layer holding more rows is paid for with more lowered layers, never less
    sizes = {**dict.fromkeys(spreads, 10), 2: 30}
    heavy = ranked_bits(spreads, dict.fromkeys(spreads, 4), sizes, 6)
    assert sum(b * sizes[i] for i, b in heavy.items()) <= 4 * sum(sizes.values())
    assert sum(b == 3 for b in heavy.values()) > sum(b == 3 for b in out.values())
    # nothing to pay with: the bits stay
    assert ranked_bits({0: 1.0}, {0: 4}, {0: 10}, 6) == {0: 4}


def test_the_worst_quantized_layer_takes_6bit_keys_at_no_more_bytes():
    entry = _entry(wide=7)
    kw = dict(bits=4, group_size=64, codec="rotated-channel", sink_tokens=4, recent_tokens=16)
    uniform = quantize_entry(list(entry), **kw).cache
    ranked = quantize_entry(list(entry), **kw, ranked_key_bits=6).cache
    assert _bits(uniform) == [4] * 12
    assert ranked[7].bits == 6 and _bits(ranked).count(6) == 2  # ceil(12 / 10) layers
    assert _bits(ranked).count(3) == 4 and entry_nbytes(ranked) <= entry_nbytes(uniform)
    back_u, back_r = dequantize_entry(uniform), dequantize_entry(ranked)
    assert all(type(a) is RotatingKVCache and a._idx == b._idx and a.offset == b.offset
               for a, b in zip(back_r, entry))

    def error(restored: list, i: int) -> float:
        return mx.mean(mx.square(restored[i].keys.astype(mx.float32)
                                 - entry[i].keys.astype(mx.float32))).item()

    assert error(back_r, 7) < error(back_u, 7) / 3  # two key bits more: ~16x less error


def _service(**flags):
    from kvplugin import plugins
    from kvplugin.cache.service.service import KVService

    pm = plugins.create_plugin_manager(load_entry_points=False)
    return KVService(resolve_settings({"kv_cache_quantization": True,
                                       "kv_cache_min_quantize_tokens": 0, **flags}),
                     host="test", hook=pm.hook, max_bytes=1 << 40)


def _stored(service, entry: list) -> list:
    return stored_after_insert(service, entry, N)


def test_the_default_4bit_ranks_an_entry_with_a_window_and_restores_it():
    service = _service(kv_cache_quantization_bits=4)
    stored = _stored(service, _entry(wide=3))
    assert stored[3].bits == RANKED_KEYS[4] and 3 in _bits(stored)
    assert service.stats()["quantization"]["ranked_key_bits"] == 6
    cache, n = service.fetch("m", list(range(N)) + [1])
    assert n == N and all(type(layer) is RotatingKVCache for layer in cache)


@pytest.mark.parametrize("flags", [
    {"kv_cache_key_bits": 4},  # bits the user gave are every layer's
    {"kv_cache_codec": "rotated-channel"},
    {"kv_cache_quantization_bits": 8},
    {"kv_cache_quantization_bits": 3},
])
def test_explicit_bits_codecs_and_other_widths_are_not_ranked(flags):
    service = _service(**{"kv_cache_quantization_bits": 4, **flags})
    stored = _stored(service, _entry(wide=3))
    assert len(set(_bits(stored))) == 1
    assert codec_plan(service.settings).ranked_key_bits is None


def test_an_entry_of_plain_layers_keeps_uniform_bits():
    service = _service(kv_cache_quantization_bits=4)
    stored = _stored(service, [_plain(i, 3.0 if i == 2 else 1.0) for i in range(12)])
    assert _bits(stored) == [4] * 12


def test_the_remote_namespace_names_the_ranking():
    from kvplugin.default_plugins.storage import entry_format

    ranked = entry_format(resolve_settings({"kv_cache_quantization": True,
                                            "kv_cache_quantization_bits": 4}))
    plain = entry_format(resolve_settings({"kv_cache_quantization": True,
                                           "kv_cache_quantization_bits": 4,
                                           "kv_cache_key_bits": 4}))
    assert ranked.endswith(":ranked-k6") and "ranked" not in plain
    # and the ring layout: replicas from before it read (and delete) such entries as damaged
    eight = entry_format(resolve_settings({"kv_cache_quantization": True}))
    assert ":rings-once" in ranked and ":rings-once" in plain and ":rings-once" not in eight


def test_kvplugins_own_bounded_rings_are_ranked_too():
    """``--max-kv-size`` layers are kvplugin's ring subclass: ranked as the host's rings."""
    from kvplugin.cache.bounded.prealloc import bound_cache

    entry, _ = bound_cache([KVCache() for _ in range(12)], SLOTS)
    for i, layer in enumerate(entry):
        k, v = _kv(i, 3.0 if i == 5 else 1.0)
        layer.update_and_fetch(k[..., :500, :], v[..., :500, :])
        for t in range(500, N):
            layer.update_and_fetch(k[..., t:t + 1, :], v[..., t:t + 1, :])
    stored = quantize_entry(entry, bits=4, group_size=64, codec="rotated-channel",
                            sink_tokens=4, recent_tokens=16, ranked_key_bits=6).cache
    assert stored[5].bits == 6 and 3 in _bits(stored)
    assert all(type(a) is type(b) for a, b in zip(dequantize_entry(stored), entry))


def test_a_ranked_entry_comes_back_from_the_ssd_tier_bit_for_bit(tmp_path):
    from kvplugin.cache.tiers.ssd import SSDTier

    entry = _entry(wide=4)
    stored = quantize_entry(list(entry), bits=4, group_size=64, codec="rotated-channel",
                            sink_tokens=4, recent_tokens=16, ranked_key_bits=6).cache
    tier = SSDTier(tmp_path / "ssd", max_bytes=1 << 30)
    tokens = list(range(N))
    assert tier.put("m", tokens, stored)
    back = tier.fetch("m", tokens + [1])[0]
    assert _bits(back) == _bits(stored) and 6 in _bits(back)
    for a, b in zip(dequantize_entry(back), dequantize_entry(stored)):
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
