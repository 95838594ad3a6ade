"""Pre-RoPE keys: a real (tiny, random-weight) mlx-lm Llama's cache, plain and bounded, stored
with its rope taken out and given back with it put back; entries without it, or without the
rope at restore, read as they must."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kvplugin.cache.codec.prerope import KEY_ROPE_ATTR, plain_runs, ring_runs, turn
from kvplugin.cache.codec.quantize import codec_name, dequantize_entry, quantize_entry
from kvplugin.cache.layers.trim import trim_entry
from kvplugin.cache.model.rope import KeyRope, key_ropes
from kvplugin.cache.service.service import KVService
from kvplugin.codecs import UnknownCodec
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings

TOKENS = 300
FOUR_BIT = dict(bits=4, group_size=64, codec="rotated-channel", sink_tokens=4, recent_tokens=16)


@pytest.fixture(scope="module")
def model():
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                           rms_norm_eps=1e-5, vocab_size=100, rope_theta=10000.0, head_dim=64,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def tokens():
    return mx.random.randint(0, 100, (1, TOKENS), key=mx.random.key(1))


def _plain(model, tokens) -> list:
    cache = make_prompt_cache(model)
    model(tokens, cache=cache)
    return trim_entry(cache)


def _rings(model, tokens, in_place: bool) -> list:
    """Bounded at 128 with 4 kept: chunks of 37 (the ring grows past its size in order) or
    one token at a time after the first 250 (wrapped in place, its newest slot mid-ring)."""
    cache = [RotatingKVCache(128, 4) for _ in model.layers]
    steps = ([(0, 250)] + [(i, i + 1) for i in range(250, TOKENS)] if in_place
             else [(s, s + 37) for s in range(0, TOKENS, 37)])
    for a, b in steps:
        model(tokens[:, a:b], cache=cache)
    mx.eval([c.keys for c in cache])
    return cache


def _max_err(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def test_the_model_s_ropes_are_read_for_a_known_family_only(model):
    ropes = key_ropes(model, make_prompt_cache(model))
    assert ropes == (KeyRope(64, False, 10000.0, 1.0),) * 2
    model.args.model_type = "deepseek_v3"  # MLA: its rope covers part of another tensor
    try:
        assert key_ropes(model, make_prompt_cache(model)) is None
    finally:
        model.args.model_type = "llama"
    assert key_ropes(model, make_prompt_cache(model)[:1]) is None  # not one cache per layer


@pytest.mark.parametrize("in_place", [False, True])
def test_a_ring_slot_s_position_is_the_token_s(model, tokens, in_place):
    """Layer 0's key of a token depends on the token and its position only: with the rope
    taken out at each slot's position, every slot of a wrapped ring holds the very key the
    unbounded cache holds at that token's row."""
    ropes = key_ropes(model, make_prompt_cache(model))
    ring = _rings(model, tokens, in_place)[0]
    runs = ring_runs(ring.offset, ring.keys.shape[-2], ring.keep, ring._idx)
    positions = np.concatenate([np.arange(p, p + n) for _, n, p in runs])
    assert len(set(positions.tolist())) == ring.keys.shape[-2] and positions.max() == TOKENS - 1
    plain = _plain(model, tokens)[0]
    pre_ring = turn(ring.keys, ropes[0], runs, -1.0)
    pre_plain = turn(plain.keys, ropes[0], plain_runs(TOKENS), -1.0)
    assert _max_err(pre_ring, pre_plain[..., mx.array(positions), :]) < 1e-5


@pytest.mark.parametrize("kind", ["plain", "ring", "ring-in-place"])
def test_pre_rope_round_trip_gives_back_the_same_layers_within_the_codec_s_error(
        model, tokens, kind):
    entry = (_plain(model, tokens) if kind == "plain"
             else _rings(model, tokens, kind == "ring-in-place"))
    ropes = key_ropes(model, make_prompt_cache(model))
    post = dequantize_entry(quantize_entry(entry, **FOUR_BIT).cache)
    stored = quantize_entry(entry, **FOUR_BIT, key_ropes=ropes).cache
    assert all(getattr(q, KEY_ROPE_ATTR) == ropes[0].record for q in stored)
    assert codec_name(stored[0]) == "rotated-channel-k4v4-s4r16+prerope"
    back = dequantize_entry(stored, key_ropes=ropes)
    for orig, got, before in zip(entry, back, post):
        assert type(got) is type(orig) and got.keys.shape == orig.keys.shape
        assert got.keys.dtype == orig.keys.dtype
        fields = ("offset", "_idx", "keep", "max_size") if kind != "plain" else ("offset",)
        assert all(getattr(got, f) == getattr(orig, f) for f in fields)
        # within the codec's error: no worse than the post-RoPE keys of the same codec
        assert _max_err(got.keys, orig.keys) < 1.2 * _max_err(before.keys, orig.keys)
        assert mx.array_equal(got.values, before.values)
        # the protected rows (kept tokens, newest) come back exactly as the model made them
        runs = ring_runs(orig.offset, orig.keys.shape[-2], orig.keep, orig._idx) \
            if kind != "plain" else plain_runs(orig.offset)
        newest = runs[-1][0] + runs[-1][1] if kind == "plain" else orig._idx
        assert mx.array_equal(got.keys[..., :4, :], orig.keys[..., :4, :])
        assert mx.array_equal(got.keys[..., newest - 8 : newest, :],
                              orig.keys[..., newest - 8 : newest, :])


@pytest.mark.parametrize("kind", ["plain", "ring"])
def test_an_entry_stored_post_rope_still_reads_with_ropes_known(model, tokens, kind):
    """What an older kvplugin wrote (no rope record) reads as it always did."""
    entry = _plain(model, tokens) if kind == "plain" else _rings(model, tokens, True)
    ropes = key_ropes(model, make_prompt_cache(model))
    old = quantize_entry(entry, **FOUR_BIT).cache
    assert not hasattr(old[0], KEY_ROPE_ATTR)
    a = dequantize_entry(old, key_ropes=ropes)
    b = dequantize_entry(old)
    assert all(mx.array_equal(x.keys, y.keys) for x, y in zip(a, b))
    assert _max_err(a[0].keys, entry[0].keys) < 0.5


@pytest.mark.parametrize("known", ["none", "other", "damaged"])
def test_a_pre_rope_entry_without_its_rope_is_a_miss(model, tokens, known):
    ropes = key_ropes(model, make_prompt_cache(model))
    stored = quantize_entry(_rings(model, tokens, True), **FOUR_BIT, key_ropes=ropes).cache
    given = ropes
    if known == "none":
        given = None
    elif known == "other":
        given = (KeyRope(64, False, 500000.0, 1.0),) * 2
    else:
        setattr(stored[1], KEY_ROPE_ATTR, "rope:64:0:ten:1.0")
    with pytest.raises(UnknownCodec):
        dequantize_entry(stored, key_ropes=given)


def _service(**extra) -> KVService:
    pm = create_plugin_manager(load_entry_points=False)
    settings = resolve_settings({"kv_cache_quantization": True, "kv_cache_quantization_bits": 4,
                                 "kv_cache_min_quantize_tokens": 0, **extra})
    return KVService(settings, host="test", hook=pm.hook, max_bytes=1 << 40)


def test_the_service_stores_a_ring_s_keys_pre_rope_once_it_learnt_the_model(model, tokens):
    """Rotating layers pre-RoPE; plain layers as before (the codec meets its goals there)."""
    ids = tokens[0].tolist()
    svc = _service()
    svc.learn_model(model, make_prompt_cache(model))
    assert svc.give_back("m", ids, _rings(model, tokens, True))
    assert set(svc.stats()["bytes_stored_by_codec"]) == {"rotated-channel-k4v4-s4r16+prerope"}
    got, n = svc.fetch("m", ids + [1])
    assert n == TOKENS and type(got[0]) is RotatingKVCache
    assert _max_err(got[0].keys, _rings(model, tokens, True)[0].keys) < 0.5
    plain = _service()
    plain.learn_model(model, make_prompt_cache(model))
    assert plain.give_back("m", ids, _plain(model, tokens))
    assert set(plain.stats()["bytes_stored_by_codec"]) == {"rotated-channel-k4v4-s4r16"}
    unknown = _service()  # a host that never handed its model over: stored as before
    assert unknown.give_back("m", ids, _rings(model, tokens, True))
    assert set(unknown.stats()["bytes_stored_by_codec"]) == {"rotated-channel-k4v4-s4r16"}
    # the same entry in a process that does not know the model's rope: a miss
    other = _service()
    other.store = svc.store
    assert other.fetch("m", ids + [1]) == (None, 0)
    off = _service(kv_cache_prerope_keys="off")
    off.learn_model(model, make_prompt_cache(model))
    assert off.give_back("m", ids, _rings(model, tokens, True))
    assert set(off.stats()["bytes_stored_by_codec"]) == {"rotated-channel-k4v4-s4r16"}


def test_pre_rope_entries_travel_through_the_ssd_tier_with_their_record(model, tokens, tmp_path):
    from kvplugin.cache.tiers.ssd import SSDTier

    ropes = key_ropes(model, make_prompt_cache(model))
    ids = tokens[0].tolist()
    for entry in (_plain(model, tokens), _rings(model, tokens, True)):
        stored = quantize_entry(entry, **FOUR_BIT, key_ropes=ropes).cache
        tier = SSDTier(tmp_path / f"ssd{type(entry[0]).__name__}", max_bytes=1 << 30)
        assert tier.put("m", ids, stored)
        cold = tier.fetch("m", ids + [1])[0]
        assert getattr(cold[0], KEY_ROPE_ATTR) == ropes[0].record
        with pytest.raises(UnknownCodec):
            dequantize_entry(cold)
        back = dequantize_entry(cold, key_ropes=ropes)
        want = dequantize_entry(stored, key_ropes=ropes)
        assert all(mx.array_equal(x.keys, y.keys) for x, y in zip(back, want))


def test_rows_of_a_stored_prefix_are_reused_only_under_the_same_rope(model, tokens):
    ropes = key_ropes(model, make_prompt_cache(model))
    short = _plain(model, tokens[:, :200])
    donor = quantize_entry(short, **FOUR_BIT, key_ropes=ropes).cache
    whole = _plain(model, tokens)
    fresh = dequantize_entry(quantize_entry(whole, **FOUR_BIT, key_ropes=ropes).cache,
                             key_ropes=ropes)
    reused = dequantize_entry(quantize_entry(whole, **FOUR_BIT, key_ropes=ropes,
                                             stored_prefix=donor).cache, key_ropes=ropes)
    assert all(_max_err(a.keys, b.keys) < 1e-2 for a, b in zip(fresh, reused))
    # a post-RoPE entry never copies pre-RoPE rows: the same as quantized afresh
    post = quantize_entry(whole, **FOUR_BIT, stored_prefix=donor).cache
    assert not hasattr(post[0], KEY_ROPE_ATTR)
    assert all(mx.array_equal(a.keys, b.keys) for a, b in
               zip(dequantize_entry(post), dequantize_entry(quantize_entry(whole, **FOUR_BIT).cache)))


def test_the_setting_names_its_flag_and_env_and_takes_documented_words_only():
    from kvplugin.codecs import codec_plan
    from kvplugin.settings import SettingsError, option_info

    on = resolve_settings({"kv_cache_quantization": True, "kv_cache_quantization_bits": 4})
    assert codec_plan(on).prerope_keys
    assert codec_plan(on).name == "rotated-channel-k4v4-s4r16+prerope"
    eight = resolve_settings({"kv_cache_quantization": True})
    assert not codec_plan(eight).prerope_keys  # affine keys are per token
    three = resolve_settings({"kv_cache_quantization": True, "kv_cache_quantization_bits": 3})
    assert not codec_plan(three).prerope_keys  # rotated-channel-sym: measured worse
    off = resolve_settings({"kv_cache_quantization": True, "kv_cache_quantization_bits": 4,
                            "kv_cache_prerope_keys": "off"})
    assert not codec_plan(off).prerope_keys
    info = option_info("kv_cache_prerope_keys")
    assert (info.flag, info.env) == ("--kv-cache-prerope-keys", "KVPLUGIN_KV_CACHE_PREROPE_KEYS")
    with pytest.raises((SettingsError, ValueError), match="kv.cache.prerope.keys|KV_CACHE_PREROPE"):
        resolve_settings({"kv_cache_prerope_keys": "maybe"})


def test_an_entry_with_a_window_takes_every_layer_pre_rope_and_a_plain_one_none():
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvplugin.cache.codec.prerope import window_ropes

    ropes = ("rope-a", "rope-b")
    assert window_ropes([RotatingKVCache(max_size=8), KVCache()], ropes) == ropes
    assert window_ropes([KVCache(), KVCache()], ropes) is None
    assert window_ropes([RotatingKVCache(max_size=8)], ropes) is None  # layers do not match
