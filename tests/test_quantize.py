"""Quantized storage of KV entries as mlx-lm's QuantizedKVCache (real MLX, CPU)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

from kvplugin.cache.codec.quantize import (
    ALLOWED_BITS,
    ALLOWED_GROUP_SIZES,
    DTYPE_ATTR,
    QuantizeResult,
    dequantize_entry,
    head_dim_of,
    quantize_entry,
    validate_bits_group,
    validate_group_size_for_model,
)
from kvplugin.cache.layers import entry_nbytes
from kvplugin.tools.bench.engine_cases import attention_roundtrip_error
from kvplugin.cache.layers.trim import trim_entry

H, D = 4, 128


def _kv(n: int, seed: int = 0, dtype=mx.float16, dim: int = D):
    k = mx.random.normal((1, H, n, dim), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, H, n, dim), key=mx.random.key(seed + 1)).astype(dtype)
    mx.eval(k, v)
    return k, v


def _filled(n: int = 300, seed: int = 0, dtype=mx.float16, dim: int = D) -> KVCache:
    """A KVCache holding n tokens in more slots (stock 256-step growth)."""
    c = KVCache()
    k, v = _kv(n, seed, dtype, dim)
    c.update_and_fetch(k, v)
    mx.eval(c.keys, c.values)
    return c


def test_validate_bits_group():
    for b in ALLOWED_BITS:
        for g in ALLOWED_GROUP_SIZES:
            validate_bits_group(b, g)
    for b, g in [(1, 64), (7, 64), (16, 64), (8, 16), (8, 256), (8.0, 64), (True, 64)]:
        with pytest.raises(ValueError):
            validate_bits_group(b, g)


def test_head_dim_of():
    ns = SimpleNamespace
    assert head_dim_of(ns(args=ns(head_dim=96, hidden_size=4096, num_attention_heads=32))) == 96
    assert head_dim_of(ns(args=ns(head_dim=None, hidden_size=4096, num_attention_heads=32))) == 128
    assert head_dim_of(ns(args=ns(text_config={"hidden_size": 64, "num_attention_heads": 4}))) == 16
    assert head_dim_of(ns(language_model=ns(args={"head_dim": 256}))) == 256
    assert head_dim_of(ns(args=ns(hidden_size=100, num_attention_heads=3))) is None
    assert head_dim_of(object()) is None


def test_validate_group_size_for_model():
    ns = SimpleNamespace
    tiny = ns(args=ns(hidden_size=64, num_attention_heads=4))  # head_dim 16
    with pytest.raises(ValueError) as e:
        validate_group_size_for_model(tiny, 64)
    msg = str(e.value)
    assert "group size 64" in msg and "head dimension 16" in msg and "cannot be used" in msg
    with pytest.raises(ValueError, match=r"head dimension 64; use one of: 32, 64$"):
        validate_group_size_for_model(ns(args=ns(head_dim=64)), 128)
    validate_group_size_for_model(ns(args=ns(head_dim=128)), 128)
    validate_group_size_for_model(object(), 64)  # unknown: skipped


def test_quantize_entry_layers_and_counts():
    plain = _filled(300)
    rotating = RotatingKVCache(64, 4)
    rotating.update_and_fetch(*_kv(10))
    native = QuantizedKVCache(group_size=64, bits=4)  # e.g. from mlx-lm's --kv-bits
    native.update_and_fetch(*_kv(10))
    narrow = _filled(20, dim=16)  # head dim 16: no group size fits
    entry = [plain, rotating, ArraysCache(2), native, KVCache(), narrow]
    res = quantize_entry(entry, bits=8, group_size=64)
    assert isinstance(res, QuantizeResult)
    # rotating layers are quantized too now (they were skipped: (1, 5) before)
    assert (res.quantized, res.skipped) == (2, 4)
    q = res.cache[0]
    assert type(q) is QuantizedKVCache and hasattr(q, "bits")
    assert (q.bits, q.group_size, q.offset) == (8, 64, 300)
    assert all(x.shape[2] == 300 for x in q.keys + q.values)
    assert type(res.cache[1]).__name__ == "QuantizedRotatingKVCache"
    assert all(o is i for o, i in zip(res.cache[2:], entry[2:]))
    assert res.cache is not entry and entry[0] is plain and plain.keys.shape[2] == 512
    with pytest.raises(ValueError):
        quantize_entry(entry, bits=7, group_size=64)


@pytest.mark.parametrize("bits,limit", [(8, 0.532), (4, 0.282)])
def test_stored_bytes_ratio(bits, limit):
    entry = [_filled(300, seed=s) for s in range(2)]
    fp16 = entry_nbytes(trim_entry(entry))
    assert fp16 == 2 * 2 * 300 * H * D * 2
    ratio = entry_nbytes(quantize_entry(entry, bits=bits, group_size=64).cache) / fp16
    assert ratio <= limit, ratio
    assert ratio > limit - 0.01  # what the format costs, no more, no less


def test_attention_roundtrip_error():
    k, v = _kv(1024, seed=5)
    errs = {b: attention_roundtrip_error(k, v, b, 64) for b in ALLOWED_BITS}
    assert errs[8] <= 0.02, errs
    assert errs[4] <= 0.2, errs
    assert [errs[b] for b in ALLOWED_BITS] == sorted(errs.values(), reverse=True)
    assert attention_roundtrip_error(k, v, 8, 64) == errs[8]  # deterministic
    assert attention_roundtrip_error(k, v, 8, 32) < attention_roundtrip_error(k, v, 8, 128)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_dequantize_restores_exact_kvcache_in_dtype(dtype):
    plain = _filled(300, seed=7, dtype=dtype)
    res = quantize_entry([plain, ArraysCache(1)], bits=8, group_size=64)
    assert getattr(res.cache[0], DTYPE_ATTR) == str(dtype).rsplit(".", 1)[-1]
    assert dequantize_entry(res.cache)[1] is res.cache[1]  # other layers: same objects
    out = dequantize_entry(copy.deepcopy(res.cache))  # mlx-lm's LRU fetch deep-copies entries
    kv = out[0]
    assert type(kv) is KVCache and kv.offset == 300
    assert kv.keys.shape == (1, H, 300, D) and kv.keys.dtype == dtype == kv.values.dtype
    err = mx.abs(kv.keys.astype(mx.float32) - plain.keys[..., :300, :].astype(mx.float32)).max()
    assert err.item() < 0.05
    assert dequantize_entry([QuantizedKVCache()])[0].empty()


def test_quantized_entry_runs_mlx_lm_quantized_attention_and_grows():
    plain = _filled(300, seed=9)
    (q,) = quantize_entry([plain], bits=8, group_size=64).cache
    k, v = _kv(1, seed=11)
    query = mx.random.normal((1, H, 1, D), key=mx.random.key(12)).astype(mx.float16)
    ref_keys, ref_values = plain.update_and_fetch(k, v)
    ref = mx.fast.scaled_dot_product_attention(query, ref_keys, ref_values, scale=D**-0.5)
    qk, qv = q.update_and_fetch(k, v)  # exact-size buffers grow on reuse
    assert q.offset == 301 and q.keys[0].shape[2] > 301
    got = scaled_dot_product_attention(query + 0, qk, qv, cache=q, scale=D**-0.5, mask=None)
    rel = mx.linalg.norm((got - ref).astype(mx.float32)) / mx.linalg.norm(ref.astype(mx.float32))
    assert rel.item() <= 0.02


def test_quantized_entry_save_load_round_trip(tmp_path):
    entry = [_filled(300, seed=13, dtype=mx.bfloat16), ArraysCache(1)]
    entry[1][0] = mx.ones((1, 3))
    res = quantize_entry(entry, bits=4, group_size=32)
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, res.cache)
    loaded = load_prompt_cache(path)
    q = loaded[0]
    assert type(q) is QuantizedKVCache and (q.bits, q.group_size, q.offset) == (4, 32, 300)
    assert not hasattr(q, DTYPE_ATTR)  # the attribute is not saved; the scales' dtype is
    for a, b in zip(list(q.keys) + list(q.values), res.cache[0].keys + res.cache[0].values):
        assert mx.array_equal(a, b).item()
    back, ref = dequantize_entry(loaded)[0], dequantize_entry(res.cache)[0]
    assert back.keys.dtype == mx.bfloat16 and mx.array_equal(back.keys, ref.keys).item()
    assert mx.array_equal(loaded[1][0], entry[1][0]).item()


def test_head_dim_of_a_real_mlx_lm_model():
    """``nn.Module`` is a dict: the lookup must still find ``model.args``."""
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": 32, "head_dim": 16,
    })
    model = llama.Model(args)
    assert head_dim_of(model) == 16
    with pytest.raises(ValueError, match="16"):
        validate_group_size_for_model(model, 64)


def test_mla_models_are_checked_against_their_real_cache_widths():
    """DeepSeek-V3/Kimi-K2 cache the kv latent and the rope key, not heads: hidden/heads (56
    for the real DeepSeek-V3) must not refuse a group size those widths accept."""
    from types import SimpleNamespace as ns

    from kvplugin.cache.codec.quantize import cache_widths

    mla = ns(args=ns(hidden_size=7168, num_attention_heads=128, kv_lora_rank=512,
                     qk_rope_head_dim=64))
    assert cache_widths(mla) == {"keys (kv latent)": 512, "values (rope key)": 64}
    assert validate_group_size_for_model(mla, 64) == []
    assert validate_group_size_for_model(mla, 128) == ["values (rope key) 64"]  # partial
    with pytest.raises(ValueError, match="cache widths 48/96"):
        validate_group_size_for_model(ns(args=ns(kv_lora_rank=96, qk_rope_head_dim=48)), 64)


def test_a_nested_cache_list_has_its_kv_child_quantized_and_restored():
    """Falcon-H1 layers are CacheList(state, attention): the attention child is K/V like any
    other and is stored quantized; the recurrent state stays full precision."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry

    nested = CacheList(ArraysCache(2), KVCache())
    nested.caches[0][0] = mx.ones((1, 2))
    keys = mx.random.normal((1, 1, 5, 64), key=mx.random.key(3))
    nested.caches[1].update_and_fetch(keys, keys * 2)
    got = quantize_entry([nested], bits=8, group_size=64)
    assert (got.quantized, got.skipped) == (1, 1)
    assert [type(c) for c in got.cache[0].caches] == [ArraysCache, QuantizedKVCache]
    assert type(nested.caches[1]) is KVCache  # the input is not changed
    back = dequantize_entry(got.cache)[0]
    assert [type(c) for c in back.caches] == [ArraysCache, KVCache]
    assert back.caches[1].offset == 5 and back.caches[0][0] is nested.caches[0][0]
    assert mx.abs(back.caches[1].keys - keys).max().item() < 0.05
