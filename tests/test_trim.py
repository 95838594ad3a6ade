"""Exact trim of KV entries (real MLX, CPU, mlx-lm's own cache classes)."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.layers import (  # moved from kvplugin.cache.layers.trim
    entry_arrays,
    entry_nbytes,
    entry_tokens,
    is_exact,
    trim_layer,
)
from kvplugin.cache.layers.trim import trim_entry

H, D = 2, 32
DT = mx.float16


def _kv(n: int, seed: int = 0, heads: int = H, dim: int = D) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed)).astype(DT)
    v = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed + 1)).astype(DT)
    mx.eval(k, v)
    return k, v


def _feed(cache, schedule, k, v, start=0):
    t = start
    for n in schedule:
        out = cache.update_and_fetch(k[..., t : t + n, :], v[..., t : t + n, :])
        mx.eval(out)
        t += n
    return t


def _attend(cache, schedule, q, k, v, start):
    """Continue a cache model-style; concatenated attention outputs (to compare two caches)."""
    outs, t = [], start
    for n in schedule:
        sl = slice(t, t + n)
        mask = cache.make_mask(n, return_array=False)
        keys, values = cache.update_and_fetch(k[..., sl, :], v[..., sl, :])
        outs.append(
            mx.fast.scaled_dot_product_attention(q[..., sl, :], keys, values, scale=0.1, mask=mask)
        )
        mx.eval(outs[-1])
        t += n
    return mx.concatenate(outs, axis=2)


def test_kvcache_trimmed_to_offset_without_touching_original():
    k, v = _kv(300)
    c = KVCache()
    _feed(c, [100, 1, 199], k, v)
    assert c.keys.shape[2] == 101 + 256  # stock growth leaves unused slots
    (t,) = trim_entry([c])
    assert type(t) is KVCache and t is not c
    assert t.offset == 300 and t.keys.shape[2] == 300 and t.values.shape[2] == 300
    assert mx.array_equal(t.keys, k).item() and mx.array_equal(t.values, v).item()
    assert c.keys.shape[2] == 357 and c.offset == 300  # original untouched
    assert entry_nbytes([t]) == 2 * 300 * H * D * 2 < entry_nbytes([c])
    assert is_exact(t) and not is_exact(c)


def test_step_attribute_carried_and_trimmed_layer_reusable():
    k, v = _kv(400, seed=2)
    c = KVCache()
    c.step = 64
    _feed(c, [130], k, v)
    (t,) = trim_entry([c])
    assert t.step == 64 and t.keys.shape[2] == 130
    _feed(t, [1], k, v, start=130)
    assert t.keys.shape[2] == 130 + 64  # grows by its own step
    _feed(t, [69], k, v, start=131)
    _feed(c, [1, 69], k, v, start=130)
    assert mx.array_equal(t.state[0][..., :200, :], c.state[0][..., :200, :]).item()


def test_exact_and_other_layers_returned_untouched():
    k, v = _kv(256)
    exact = KVCache()
    _feed(exact, [256], k, v)
    chunked = ChunkedKVCache(64)
    _feed(chunked, [10], k, v)
    chunked = trim_entry([chunked])[0]
    layers = [exact, KVCache(), ArraysCache(2), CacheList(KVCache()), chunked, QuantizedKVCache()]
    out = trim_entry(layers)
    assert out is not layers
    assert all(o is i for o, i in zip(out, layers))


def test_chunked_and_nested_attention_are_cut_to_what_they_hold():
    """Llama 4's chunked layers and Falcon-H1's ``CacheList`` (recurrent state + attention)
    kept their growth slack in the store (measured: 743 against 418 KiB and 545 against 327
    KiB for the tiny models at 300 tokens); cut, they continue exactly like the originals."""
    k, v = _kv(400, seed=3)
    q = mx.random.normal(k.shape, key=mx.random.key(9))
    chunked = ChunkedKVCache(64)  # as llama4 leaves it after its front was trimmed: tokens
    chunked.keys = mx.concatenate([k[..., 36:130, :], mx.zeros_like(k[..., :226, :])], axis=2)
    chunked.values = mx.concatenate([v[..., 36:130, :], mx.zeros_like(v[..., :226, :])], axis=2)
    chunked.offset, chunked.start_position = 130, 36  # [36, 130) held in 320 slots
    state = ArraysCache(1)
    state[0] = mx.ones((1, 3, 8))
    nested = CacheList(state, KVCache())
    _feed(nested.caches[1], [130], k, v)
    for layer, used in ((chunked, 94), (nested, 130)):
        original = [layer]
        (cut,) = trim_entry(list(original))
        kv = cut.caches[1] if isinstance(cut, CacheList) else cut
        assert cut is not layer and kv.keys.shape[2] == used
        if isinstance(cut, CacheList):
            assert cut.caches[0] is state  # the recurrent state is kept as it is
        ref = layer.caches[1] if isinstance(layer, CacheList) else layer
        outs = []
        for cache in (kv, ref):  # the next 20 tokens, attended causally over what is held
            keys, values = cache.update_and_fetch(k[..., 130:150, :], v[..., 130:150, :])
            outs.append(mx.fast.scaled_dot_product_attention(
                q[..., 130:150, :], keys, values, scale=0.1, mask="causal"))
        assert mx.array_equal(*outs).item()


@pytest.mark.parametrize("heads", [1, 8])
def test_original_buffer_really_released(heads):
    """Dropping the original after trim frees its big buffer; a plain slice would keep it."""
    k, v = _kv(1000, heads=heads, dim=64)

    def build():
        c = KVCache()
        c.step = 8192  # 1000 tokens in 8192 slots
        _feed(c, [1000], k, v)
        return c

    def resident(make_copy):
        gc.collect()
        mx.synchronize()
        base = mx.get_active_memory()
        c = build()
        kept = make_copy(c)
        mx.eval(kept)
        del c
        gc.collect()
        mx.synchronize()
        return mx.get_active_memory() - base, kept

    big = 2 * 8192 * heads * 64 * 2
    used = 2 * 1000 * heads * 64 * 2
    held, kept = resident(lambda c: trim_entry([c])[0].state[:2])
    assert held <= used * 1.05, (held, used)
    del kept
    held, kept = resident(lambda c: (c.keys[..., :1000, :], c.values[..., :1000, :]))
    assert held >= big  # control: a view keeps the parent alive, so the probe can fail
    del kept


def test_quantized_layer_trimmed_per_component():
    k, v = _kv(300, seed=4, dim=64)
    q = QuantizedKVCache(group_size=64, bits=8)
    _feed(q, [300], k, v)
    assert q.keys[0].shape[2] == 512
    (t,) = trim_entry([q])
    assert type(t) is QuantizedKVCache and (t.bits, t.group_size, t.offset) == (8, 64, 300)
    assert isinstance(t.keys, tuple) and all(x.shape[2] == 300 for x in t.keys + t.values)
    for a, b in zip(t.keys + t.values, q.keys + q.values):
        assert mx.array_equal(a, b[..., :300, :]).item()
    assert entry_nbytes([t]) < entry_nbytes([q])
    _feed(t, [1, 5], k, v, start=294)  # still usable: grows again
    assert t.offset == 306


def test_rotating_not_wrapped_trimmed_and_equivalent():
    q, k, v = (_kv(700, seed=s)[0] for s in (10, 11, 12))
    c = RotatingKVCache(1024, 4)
    _feed(c, [1] * 300, k, v)
    assert c.keys.shape[2] == 512
    (t,) = trim_entry([c])
    assert type(t) is RotatingKVCache and t.keys.shape[2] == 300 and t._idx == 300
    a = _attend(c, [1] * 5 + [100, 1] + [1] * 10, q, k, v, 300)
    b = _attend(t, [1] * 5 + [100, 1] + [1] * 10, q, k, v, 300)
    assert mx.array_equal(a, b).item()


def test_rotating_after_prefill_trimmed_to_max_size_and_equivalent():
    q, k, v = (_kv(1400, seed=s)[0] for s in (20, 21, 22))
    c = RotatingKVCache(256, 4)
    _feed(c, [300, 200], k, v)
    assert c.keys.shape[2] == 455  # stock keeps max_size + L - 1
    (t,) = trim_entry([c])
    assert type(t) is RotatingKVCache and t.keys.shape[2] == 256 and t.offset == 500
    assert is_exact(t) and not is_exact(c)
    schedule = [1] * 300 + [100] + [1] * 20 + [50, 3]
    assert mx.array_equal(
        _attend(c, schedule, q, k, v, 500), _attend(t, schedule, q, k, v, 500)
    ).item()
    # Wrapped in place (exactly max_size slots): already minimal, same object.
    assert c.keys.shape[2] == 255 + 3 and not is_exact(c)
    _feed(c, [1], k, v, start=973)
    assert c.keys.shape[2] == 256 and trim_entry([c])[0] is c


def test_preallocated_rotating_trimmed_while_not_full():
    q, k, v = (_kv(1000, seed=s)[0] for s in (30, 31, 32))
    c = PreallocatedRotatingKVCache(512, 4)
    ref = RotatingKVCache(512, 4)
    _feed(c, [200, 1], k, v)
    _feed(ref, [200, 1], k, v)
    assert c.keys.shape[2] == 256  # grown in steps (changed on purpose: was the whole bound)
    (t,) = trim_entry([c])
    assert type(t) is PreallocatedRotatingKVCache and t.keys.shape[2] == 201
    schedule = [1] * 3 + [400] + [1] * 5 + [300]
    assert mx.array_equal(
        _attend(ref, schedule, q, k, v, 201), _attend(t, schedule, q, k, v, 201)
    ).item()
    assert t.keys.shape[2] == 512  # grown back to the bound once reused and wrapped
    assert t.offset > 512 and trim_entry([t])[0] is t  # full: nothing to trim


def test_zero_offset_layer_becomes_empty():
    k, v = _kv(10)
    c = KVCache()
    _feed(c, [10], k, v)
    c.trim(10)
    t = trim_layer(c)
    assert t is not c and t.keys is None and t.offset == 0 and t.empty()
    assert c.keys is not None


def test_trimmed_entry_save_load_round_trip(tmp_path):
    k, v = _kv(400, seed=40)
    c = KVCache()
    _feed(c, [300], k, v)
    r = RotatingKVCache(256, 4)
    _feed(r, [300, 100], k, v)
    entry = trim_entry([c, r])
    path = str(tmp_path / "e.safetensors")
    save_prompt_cache(path, entry)
    a, b = load_prompt_cache(path)
    assert a.offset == 300 and mx.array_equal(a.keys[..., :300, :], k[..., :300, :]).item()
    assert (b.offset, b.max_size, b.keep, b.keys.shape[2]) == (400, 256, 4, 256)


def test_entry_helpers():
    k, v = _kv(50)
    a, b = KVCache(), RotatingKVCache(16, 0)
    _feed(a, [50], k, v)
    _feed(b, [50], k, v)
    assert entry_tokens([a, b, ArraysCache(1)]) == 50
    assert entry_tokens([]) is None  # was 0: "no layer counts tokens" is now said as None
    assert entry_nbytes([a]) == a.nbytes
    assert entry_nbytes([a, a]) == a.nbytes  # shared arrays counted once
    assert entry_nbytes([QuantizedKVCache(), KVCache()]) == 0
    arrays = entry_arrays([a, b, a])
    assert len(arrays) == 4 and {id(x) for x in arrays} == {
        id(a.keys),
        id(a.values),
        id(b.keys),
        id(b.values),
    }


