"""The 4- and 3-bit defaults on wide heads: in an entry with a window (sliding,
``--max-kv-size``), keys take a bit more (4 bits: k5v4; 3 bits: k4v2), paid for by groups of
128, on every layer whose heads a group of 128 divides; narrower heads, entries of plain
layers only and explicit choices keep the bits in groups of 64. At 8 bits an entry with a
window or recurrent state takes ``rotated-channel`` where plain entries take ``affine``.
Through the real service and the default quantize hook."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from kvplugin.cache.codec.quantize import dequantize_entry
from kvplugin.codecs import CODEC_ATTR, WIDE_HEADS, WINDOW_CODECS, codec_plan, layer_bits_group
from kvplugin.settings import resolve_settings
from kvcaches import stored_after_insert

N = 300


def _service(**flags):
    from kvplugin import plugins
    from kvplugin.cache.service.service import KVService

    pm = plugins.create_plugin_manager(load_entry_points=False)
    return KVService(resolve_settings({"kv_cache_quantization": True,
                                       "kv_cache_min_quantize_tokens": 0, **flags}),
                     host="test", hook=pm.hook, max_bytes=1 << 40)


def _kv(width: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, 1, N, width), key=mx.random.key(seed))
    k = k * mx.array(np.where(np.arange(width) % 16 == 3, 20.0, 1.0).astype(np.float32))
    v = mx.random.normal((1, 1, N, width), key=mx.random.key(seed + 1))
    return k.astype(mx.float16), v.astype(mx.float16)


def _plain(width: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(*_kv(width))
    return c


def _ring(width: int) -> RotatingKVCache:
    c = RotatingKVCache(max_size=128, keep=0)
    k, v = _kv(width)
    c.update_and_fetch(k[..., :100, :], v[..., :100, :])
    for i in range(100, N):  # one token at a time, as decoding: the ring wraps
        c.update_and_fetch(k[..., i:i + 1, :], v[..., i:i + 1, :])
    return c


def _stored(service, entry: list) -> list:
    return stored_after_insert(service, entry, N)


def test_default_4bit_takes_5bit_keys_in_groups_of_128_on_wide_heads_of_a_windowed_entry():
    service = _service(kv_cache_quantization_bits=4)
    stored = _stored(service, [_ring(256), _plain(256), _ring(128), _ring(64)])
    assert [(layer.bits, layer.group_size) for layer in stored] == [
        (5, 128), (5, 128), (5, 128), (4, 64)]  # the window's global layer too
    assert {getattr(layer, "kvplugin_value_bits", layer.bits) for layer in stored} == {4}
    names = "+".join(service.stats()["bytes_stored_by_codec"]).split("+")  # per layer
    assert {name.split("-s")[0] for name in names} == {"rotated-channel-k5v4",
                                                       "rotated-channel-k4v4"}


def test_an_entry_of_plain_layers_keeps_4bit_keys_on_wide_heads():
    stored = _stored(_service(kv_cache_quantization_bits=4), [_plain(256), _plain(128)])
    assert [(layer.bits, layer.group_size) for layer in stored] == [(4, 64), (4, 64)]


@pytest.mark.parametrize("flags", [
    {"kv_cache_quantization_group_size": 64},  # a group the user chose is kept
    {"kv_cache_key_bits": 4},
    {"kv_cache_codec": "rotated-channel"},
])
def test_explicit_choices_keep_4bit_keys_on_wide_heads(flags):
    plan = codec_plan(resolve_settings({"kv_cache_quantization_bits": 4, **flags}))
    assert plan.wide_head_keys is None
    layer = _stored(_service(kv_cache_quantization_bits=4, **flags), [_ring(256)])[0]
    assert (layer.bits, layer.group_size) == (4, 64)


def test_only_the_4_and_3bit_defaults_widen():
    for bits in (8, 5, 2):
        assert codec_plan(resolve_settings({"kv_cache_quantization_bits": bits})
                          ).wide_head_keys is None
    plan = codec_plan(resolve_settings({"kv_cache_quantization_bits": 4}))
    assert plan.wide_head_keys == WIDE_HEADS[4] == (5, 4, 128)
    assert layer_bits_group(4, 4, 64, plan.wide_head_keys, 256, 256) == (5, 4, 128)
    assert layer_bits_group(4, 4, 64, plan.wide_head_keys, 64, 64) == (4, 4, 64)
    assert layer_bits_group(4, 4, 64, plan.wide_head_keys, 256, 64) == (4, 4, 64)
    three = codec_plan(resolve_settings({"kv_cache_quantization_bits": 3}))
    assert three.wide_head_keys == WIDE_HEADS[3] == (4, 2, 128)
    assert three.codec == "rotated-channel-sym"  # the codec stays the 3-bit one
    assert "k4v2 in groups of 128" in three.description


def test_default_3bit_takes_4bit_keys_and_2bit_values_in_groups_of_128_on_wide_heads():
    service = _service(kv_cache_quantization_bits=3)
    stored = _stored(service, [_ring(256), _plain(256), _ring(64)])
    assert [(layer.bits, getattr(layer, "kvplugin_value_bits", layer.bits), layer.group_size)
            for layer in stored] == [(4, 2, 128), (4, 2, 128), (3, 3, 64)]
    names = "+".join(service.stats()["bytes_stored_by_codec"]).split("+")
    assert {re.sub(r"-s\d+r\d+.*", "", name) for name in names} == {
        "rotated-channel-sym-k4v2", "rotated-channel-sym-k3v3"}
    plain = _stored(_service(kv_cache_quantization_bits=3), [_plain(256)])
    assert [(layer.bits, layer.group_size) for layer in plain] == [(3, 64)]


def test_wide_head_entries_restore_closer_than_4bit_keys():
    """The fifth key bit is what the rule is for: a hit's keys come back closer, on the
    window and on the plain layer of the entry alike."""
    def key_error(**flags) -> float:
        source = [_ring(256), _plain(256)]
        stored = _stored(_service(kv_cache_quantization_bits=4, **flags),
                         [_ring(256), _plain(256)])
        back = dequantize_entry(list(stored))
        assert [type(b) for b in back] == [type(s) for s in source]
        assert [b.offset for b in back] == [s.offset for s in source]
        rows = [source[0].keys.shape[-2], N]  # the ring's slots, the plain layer's tokens
        return sum(float(mx.abs(b.keys[..., :n, :].astype(mx.float32)
                                - s.keys[..., :n, :].astype(mx.float32)).mean())
                   for b, s, n in zip(back, source, rows))

    assert key_error() < 0.75 * key_error(kv_cache_quantization_group_size=64)


def test_default_8bit_takes_rotated_channel_keys_in_an_entry_with_a_window():
    service = _service(kv_cache_quantization_bits=8)
    stored = _stored(service, [_ring(64), _plain(64)])
    assert [getattr(layer, CODEC_ATTR, "affine") for layer in stored] == [
        "rotated-channel", "rotated-channel"]  # the window's global layer too
    assert [(layer.bits, layer.group_size) for layer in stored] == [(8, 64), (8, 64)]
    assert set(service.stats()["bytes_stored_by_codec"]) == {"rotated-channel-k8v8"}  # keys
    # post-RoPE, nothing protected: the row measured on Gemma 3
    plain = _stored(_service(kv_cache_quantization_bits=8), [_plain(64)])
    assert getattr(plain[0], CODEC_ATTR, "affine") == "affine"
    stats = service.stats()["quantization"]
    assert (stats["codec"], stats["window_codec"]) == ("affine", WINDOW_CODECS[8])


def _state() -> ArraysCache:
    c = ArraysCache(size=2)
    c[0] = mx.random.normal((1, 3, 64), key=mx.random.key(5))
    c[1] = mx.random.normal((1, 2, 64, 64), key=mx.random.key(6))
    return c


@pytest.mark.parametrize("nested", [False, True], ids=["qwen3-next", "falcon-h1"])
def test_default_8bit_takes_rotated_channel_keys_in_an_entry_with_recurrent_state(nested):
    """A hybrid's attention layers (beside its recurrent layers, or nested with them in a
    ``CacheList``) take the codec entries with a window take; the state its own codec."""
    entry = ([CacheList(_state(), _plain(64))] if nested else [_state(), _plain(64)])
    stored = _stored(_service(kv_cache_quantization_bits=8), entry)
    attention = stored[0].caches[1] if nested else stored[1]
    assert getattr(attention, CODEC_ATTR, "affine") == WINDOW_CODECS[8]
    assert (attention.bits, attention.group_size) == (8, 64)
    state = stored[0].caches[0] if nested else stored[0]
    assert type(state).__name__ == "QuantizedArraysCache"
    back = dequantize_entry(list(stored))
    kv = back[0].caches[1] if nested else back[1]
    assert type(kv) is KVCache and kv.offset == N


def test_8bit_windowed_keys_restore_closer_than_affine():
    """What the window codec is for: per-channel keys come back closer than per-token affine
    ones at the same bits (keys with outlier channels, as real keys have)."""
    def key_error(**flags) -> float:
        stored = _stored(_service(kv_cache_quantization_bits=8, **flags), [_ring(64)])
        back, source = dequantize_entry(list(stored))[0], _ring(64)
        return float(mx.abs(back.keys.astype(mx.float32)
                            - source.keys.astype(mx.float32)).mean())

    assert key_error() < 0.75 * key_error(kv_cache_codec="affine")


@pytest.mark.parametrize("flags", [
    {"kv_cache_codec": "affine"},  # a codec the user named is kept on every layer
    {"kv_cache_key_bits": 8},
    {"kv_cache_quantization_bits": 4},  # 4 bits are rotated-channel everywhere already
])
def test_explicit_choices_and_other_widths_take_no_window_codec(flags):
    settings = {"kv_cache_quantization_bits": 8, **flags}
    plan = codec_plan(resolve_settings(settings))
    assert plan.window_codec is None
    assert plan.codec_for(plain=False) == plan.codec
    layer = _stored(_service(**settings), [_ring(64)])[0]
    assert getattr(layer, CODEC_ATTR, "affine") == plan.codec


def test_the_window_codec_is_in_the_start_up_line_and_the_remote_namespace():
    from kvplugin.default_plugins.storage import entry_format

    settings = resolve_settings({"kv_cache_quantization": True, "kv_cache_quantization_bits": 8})
    assert ("rotated-channel in entries with a window or recurrent state"
            in codec_plan(settings).description)
    assert entry_format(settings).endswith(":window-state-rotated-channel")
    assert "window" not in entry_format(resolve_settings({
        "kv_cache_quantization": True, "kv_cache_quantization_bits": 8,
        "kv_cache_codec": "affine"}))
