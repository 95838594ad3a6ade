"""PreallocatedRotatingKVCache vs stock RotatingKVCache (real MLX, CPU); stepped/bounded caches."""

from __future__ import annotations

import copy
import gc

import mlx.core as mx
import mlx_lm.models.cache as mlc
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

from kvplugin.cache.bounded.prealloc import (
    PreallocatedRotatingKVCache,
    apply_growth_step,
    bound_cache,
    make_stepped_kv_cache,
    register_with_mlx_lm,
    rewind_decode,
)

H, D = 2, 32
DT = mx.float16
# Prefill chunks of varying size, decode runs, a chunk larger than the window, tiny chunks.
SCHEDULE = [300, 700] + [1] * 1000 + [129, 1000] + [1] * 900 + [513, 2] + [1] * 100


def _data(n: int, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    q, k, v = (
        mx.random.normal((1, H, n, D), key=mx.random.key(seed * 3 + i)).astype(DT) for i in range(3)
    )
    mx.eval(q, k, v)
    return q, k, v


def _step(cache, q, k, v, window=None) -> mx.array:
    """One model-style attention step: mask from the cache *before* the update, then SDPA."""
    mask = cache.make_mask(k.shape[2], window_size=window, return_array=False)
    keys, values = cache.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)


def _run(caches, schedule, data, start=0, window=None, check=None):
    """Feed the same chunks to every cache; return each cache's concatenated outputs."""
    q, k, v = data
    outs = [[] for _ in caches]
    t = start
    for n in schedule:
        sl = slice(t, t + n)
        for c, o in zip(caches, outs):
            o.append(_step(c, q[..., sl, :], k[..., sl, :], v[..., sl, :], window))
        mx.eval([o[-1] for o in outs], [(c.keys, c.values) for c in caches])
        if check:
            check()
        t += n
    return [mx.concatenate(o, axis=2) for o in outs]


@pytest.mark.parametrize(
    "max_size,keep,window",
    [(512, 4, None), (512, 0, 128), (1024, 4, None)],
    ids=["512-keep4", "512-keep0-window128", "1024-keep4"],
)
def test_attention_outputs_bitwise_equal_to_stock(max_size, keep, window):
    n = sum(SCHEDULE)
    assert n >= 4096
    stock, ours = RotatingKVCache(max_size, keep), PreallocatedRotatingKVCache(max_size, keep)

    def check():
        # changed on purpose: the buffer grows in steps to the bound (it used to be allocated
        # whole on first use); once full it is exactly the bound
        assert ours.keys.shape[2] <= max_size and ours.values.shape[2] <= max_size
        if ours.offset >= max_size:
            assert ours.nbytes == 2 * max_size * H * D * 2
        assert (ours.offset, ours.size()) == (stock.offset, stock.size())

    a, b = _run([stock, ours], SCHEDULE, _data(n), window=window, check=check)
    assert a.shape == (1, H, n, D)
    assert mx.array_equal(a, b).item()
    assert stock.offset == n > 4 * max_size  # wrapped several times


def test_stock_needs_more_slots_after_prefill():
    stock, ours = RotatingKVCache(256, 4), PreallocatedRotatingKVCache(256, 4)
    _run([stock, ours], [300, 200], _data(500))
    assert stock.keys.shape[2] == 255 + 200
    assert ours.keys.shape[2] == 256


def _mem_now() -> int:
    mx.synchronize()
    return mx.get_active_memory()


def _peak_since_reset() -> int:
    mx.synchronize()
    return max(mx.get_peak_memory(), mx.get_active_memory())


def _fill(cache, schedule, k):
    """Feed chunks without attention, dropping returned views at once (as a model step does)
    and evaluating the cache state after each (as mlx-lm's prefill loop does)."""
    t = 0
    for n in schedule:
        out = cache.update_and_fetch(k[..., t : t + n, :], k[..., t : t + n, :])
        mx.eval(out, cache.keys, cache.values)
        del out
        t += n


MEM_H, MEM_D, MEM_MAX = 8, 64, 2048
TOKEN_BYTES = 2 * MEM_H * MEM_D * 2  # keys + values, fp16


def _mem_tokens(n: int) -> mx.array:
    x = mx.random.normal((1, MEM_H, n, MEM_D), key=mx.random.key(7)).astype(DT)
    mx.eval(x)
    return x


MEM_LAYERS = 8


def _decode_fill(caches, n, toks):
    """One token at a time into every layer; (held bytes, peak growth) after each step."""
    base = _mem_now()
    mx.reset_peak_memory()
    held = []
    for t in range(n):
        outs = [c.update_and_fetch(toks[..., t:t + 1, :], toks[..., t:t + 1, :]) for c in caches]
        mx.eval(outs, [c.keys for c in caches], [c.values for c in caches])
        del outs
        held.append(sum(c.nbytes for c in caches))
    return held, _peak_since_reset() - base


def test_bounded_cache_holds_its_tokens_plus_one_growth_step_and_no_more_while_growing():
    """Changed on purpose (it used to allocate the whole bound on first use): at every length
    the layers hold their tokens plus one growth step at most (256 slots, or 1/layers of what
    a layer holds), and growing never holds more than one layer's buffer twice."""
    toks = _mem_tokens(MEM_MAX)
    gc.collect()
    caches, _ = bound_cache([KVCache() for _ in range(MEM_LAYERS)], MEM_MAX)
    held, peak = _decode_fill(caches, MEM_MAX, toks)
    layer_bytes = TOKEN_BYTES  # per token per layer
    for t, h in enumerate(held, start=1):
        step = max(256, -(-(t // MEM_LAYERS) // 256) * 256)
        assert h <= MEM_LAYERS * (t + step) * layer_bytes, (t, h)
    final = held[-1]
    assert final == MEM_LAYERS * MEM_MAX * layer_bytes  # full: exactly the bound
    assert peak <= final + MEM_MAX * layer_bytes * 1.02, (peak, final)  # + one layer's copy
    # stock grows every layer on the same step by concatenation: old + new buffer at once
    stock = [RotatingKVCache(MEM_MAX, 4) for _ in range(MEM_LAYERS)]
    _, stock_peak = _decode_fill(stock, MEM_MAX, toks)
    assert stock_peak > peak


def test_growth_points_are_staggered_across_layers():
    """At most one layer grows (copies its buffer) on any decode step."""
    toks = _mem_tokens(MEM_MAX)
    caches, _ = bound_cache([KVCache() for _ in range(MEM_LAYERS)], MEM_MAX)
    caps = [0] * MEM_LAYERS
    for t in range(MEM_MAX):
        for c in caches:
            c.update_and_fetch(toks[..., t:t + 1, :], toks[..., t:t + 1, :])
        now = [c.keys.shape[2] for c in caches]
        if t > 0:
            assert sum(a != b for a, b in zip(now, caps)) <= 1, (t, caps, now)
        caps = now


def test_prefill_chunk_memory():
    L = 300
    toks = _mem_tokens(MEM_MAX + L)
    gc.collect()
    ours = PreallocatedRotatingKVCache(MEM_MAX, 4)
    _fill(ours, [700], toks)
    assert ours.nbytes == 768 * TOKEN_BYTES  # 700 tokens, rounded up to the growth unit

    # A chunk that still fits its buffer is written in place: nothing beyond its own tokens.
    before = _mem_now()
    mx.reset_peak_memory()
    _fill(ours, [60], toks[..., 700:, :])
    assert _peak_since_reset() - before <= 60 * TOKEN_BYTES
    _fill(ours, [1] * (MEM_MAX - 760 + 50), toks)  # now wrapped
    buffer = ours.nbytes
    assert buffer == MEM_MAX * TOKEN_BYTES

    # A wrapping chunk needs its attention window (max-1+L slots) once, then only the buffer.
    before = _mem_now()
    mx.reset_peak_memory()
    _fill(ours, [L], toks)
    window = (MEM_MAX - 1 + L) * TOKEN_BYTES
    assert _peak_since_reset() - before <= window * 1.02
    assert _mem_now() - before <= 0.01 * buffer
    assert ours.keys.shape[2] == MEM_MAX


def test_trim_and_mask_methods_match_stock():
    max_size, keep = 256, 4
    stock, ours = RotatingKVCache(max_size, keep), PreallocatedRotatingKVCache(max_size, keep)
    assert ours.empty() and ours.nbytes == 0 and ours.size() == 0
    data = _data(600, seed=1)
    _run([stock, ours], [100, 1, 1, 50], data)
    assert ours.is_trimmable() and stock.is_trimmable()
    assert ours.trim(20) == stock.trim(20) == 20
    assert ours.size() == stock.size() == 132
    a, b = _run([stock, ours], [30, 1, 200, 1, 1, 90], data, start=200)
    assert mx.array_equal(a, b).item()
    assert not ours.is_trimmable() and not stock.is_trimmable()
    for n, w in [(1, None), (1, 64), (7, None), (7, 64)]:
        ma, mb = stock.make_mask(n, window_size=w), ours.make_mask(n, window_size=w)
        assert type(ma) is type(mb)
        if isinstance(ma, mx.array):
            assert mx.array_equal(ma, mb).item()


def test_deepcopy_is_independent():
    stock, ours = RotatingKVCache(128, 4), PreallocatedRotatingKVCache(128, 4)
    data = _data(400, seed=2)
    _run([stock, ours], [100, 1, 1], data)
    clone = copy.deepcopy(ours)
    _run([ours], [50] + [1] * 10, data, start=102)
    a, b = _run([stock, clone], [60, 1, 1, 1], data, start=102)
    assert mx.array_equal(a, b).item()


def test_batch_merge_matches_stock():
    stock, ours = RotatingKVCache(128, 4), PreallocatedRotatingKVCache(128, 4)
    _run([stock, ours], [1] * 200, _data(200, seed=3))
    ms, mo = RotatingKVCache.merge([stock]), RotatingKVCache.merge([ours])
    assert mx.array_equal(ms.keys, mo.keys).item() and mx.array_equal(ms.values, mo.values).item()


@pytest.mark.parametrize("tokens", [[300], [300, 700, 1, 1]], ids=["not-full", "wrapped"])
def test_save_load_round_trip(tmp_path, tokens):
    register_with_mlx_lm()
    max_size = 512
    stock, ours = RotatingKVCache(max_size, 4), PreallocatedRotatingKVCache(max_size, 4)
    n = sum(tokens)
    data = _data(n + 400, seed=4)
    _run([stock, ours], tokens, data)
    path = str(tmp_path / "entry.safetensors")
    save_prompt_cache(path, [ours], {"k": "v"})
    (loaded,), meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"k": "v"}
    assert type(loaded) is PreallocatedRotatingKVCache
    assert (loaded.offset, loaded.keep, loaded.max_size) == (n, 4, max_size)
    assert loaded.keys.shape[2] == min(n, max_size)  # not-full entries are saved exact-size
    rest = [200, 1, 1, 3, 1]
    a, b = _run([stock, loaded], rest, data, start=n)
    assert mx.array_equal(a, b).item()
    assert loaded.keys.shape[2] == max_size


def test_register_with_mlx_lm_is_idempotent():
    register_with_mlx_lm()
    register_with_mlx_lm()
    assert mlc.PreallocatedRotatingKVCache is PreallocatedRotatingKVCache
    assert mlc.RotatingKVCache is RotatingKVCache


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError):
        PreallocatedRotatingKVCache(0)
    with pytest.raises(ValueError):
        PreallocatedRotatingKVCache(8, keep=8)


def test_stepped_kv_cache_preallocates():
    c = make_stepped_kv_cache(1000)
    assert type(c) is KVCache and c.step == 1000 and KVCache.step == 256
    k = mx.zeros((1, H, 10, D), DT)
    keys, _ = c.update_and_fetch(k, k)
    assert keys.shape[2] == 10 and c.keys.shape[2] == 1000
    c.update_and_fetch(mx.zeros((1, H, 991, D), DT), mx.zeros((1, H, 991, D), DT))
    assert c.keys.shape[2] == 10 + 1000  # stock growth: used slots + ceil(S/step)*step
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError):
            make_stepped_kv_cache(bad)


def test_apply_growth_step():
    layers = [KVCache(), QuantizedKVCache(), RotatingKVCache(64), ArraysCache(2)]
    out = apply_growth_step(layers, 4096)
    assert out is layers
    assert layers[0].step == 4096 and layers[1].step == 4096
    assert "step" not in vars(layers[2]) and not hasattr(layers[3], "step")
    k = mx.zeros((1, H, 3, D), DT)
    layers[0].update_and_fetch(k, k)
    assert layers[0].keys.shape[2] == 4096
    with pytest.raises(ValueError):
        apply_growth_step(layers, 0)


def test_bound_cache():
    full = KVCache()
    full.update_and_fetch(mx.zeros((1, H, 3, D), DT), mx.zeros((1, H, 3, D), DT))
    already = PreallocatedRotatingKVCache(512, 4)
    layers = [
        KVCache(),
        RotatingKVCache(128, 0),  # a model's sliding window, smaller than the bound: kept
        RotatingKVCache(8192, 2),  # larger than the bound: bounded
        already,
        ArraysCache(2),  # fixed-size recurrent state
        QuantizedKVCache(),
        full,
        CacheList(KVCache(), ArraysCache(1)),
    ]
    out, unbounded = bound_cache(layers, 1024)
    assert out is not layers and len(out) == len(layers)
    assert [type(c).__name__ for c in out[:3]] == ["PreallocatedRotatingKVCache"] * 3
    assert (out[0].max_size, out[0].keep) == (1024, 4)
    assert (out[1].max_size, out[1].keep) == (128, 0)
    assert (out[2].max_size, out[2].keep) == (1024, 2)
    assert all(o is i for o, i in zip(out[3:], layers[3:]))
    assert unbounded == 3  # quantized, non-empty KVCache, CacheList
    assert bound_cache([KVCache()], 64, keep=0)[0][0].keep == 0
    for bad in ((0, 4), (16, 16), (True, 0)):
        with pytest.raises(ValueError):
            bound_cache([KVCache()], bad[0], keep=bad[1])


def test_adopts_a_stock_cache_state():
    """A stock cache's state (here: post-prefill, longer than max_size) moved into our class."""
    stock = RotatingKVCache(256, 4)
    data = _data(1200, seed=5)
    _run([stock], [300, 200], data)
    assert stock.keys.shape[2] == 455
    ours = copy.copy(stock)
    ours.__class__ = PreallocatedRotatingKVCache
    schedule = [1] * 30 + [100, 1, 1] + [300] + [1] * 5
    a, b = _run([stock, ours], schedule, data, start=500)
    assert mx.array_equal(a, b).item()
    assert ours.keys.shape[2] == 256


def _state_equal(a, b) -> bool:
    sa, sb = tuple(a.state)[:2], tuple(b.state)[:2]
    return (a.offset, a._idx, a.keep, a.max_size) == (b.offset, b._idx, b.keep, b.max_size) and all(
        x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(sa, sb)
    )


@pytest.mark.parametrize("prefill,decode,back", [
    (300, 40, 40),   # wrapped by the prefill, all decode taken back
    (300, 40, 17),   # part of it
    (200, 100, 100),  # wraps during decode (the ring wraps from max_size to keep)
    (600, 240, 240),  # most of the ring
    (300, 200, 150),  # several undo blocks (64 slots here)
    (260, 240, 200),  # the ring's end reached during decode: next write back at keep
    (100, 20, 20),   # never wrapped: the stock trim
])
def test_trim_after_wrap_restores_the_exact_state(prefill, decode, back, monkeypatch):
    """trim(n) after one-token writes on a wrapped ring = a cache that never saw those tokens,
    bitwise (arrays, offset, _idx), and it continues identically."""
    monkeypatch.setattr(PreallocatedRotatingKVCache, "UNDO_BLOCK", 64)
    data = _data(prefill + decode + 50, seed=7)
    ours, ref = PreallocatedRotatingKVCache(256, 4), PreallocatedRotatingKVCache(256, 4)
    _run([ours], [prefill] + [1] * decode, data)
    _run([ref], [prefill] + [1] * (decode - back), data)
    assert ours.is_trimmable() and ours.undo_len() == decode
    assert ours.trim(back) == back
    assert _state_equal(ours, ref)
    start = prefill + decode - back
    a, b = _run([ours, ref], [1] * 20 + [30], data, start=start)
    assert mx.array_equal(a, b).item()


def test_undo_log_limits():
    """A chunk resets the log; more writes than the ring drop it (no slot written twice);
    only the logged writes can be taken back."""
    data = _data(1200, seed=3)
    c = PreallocatedRotatingKVCache(64, 4)
    _run([c], [100] + [1] * 10, data)
    assert c.trim(50) == 10 and c.offset == 100  # only the 10 logged writes come back
    _run([c], [5], data, start=100)  # a chunk: nothing logged since
    assert c.undo_len() == 0 and not c.is_trimmable() and c.trim(1) == 0
    _run([c], [1] * 61, data, start=105)  # more than the ring (60 slots): log dropped
    assert c.undo_len() == 0 and not c.is_trimmable()
    assert c.undo_nbytes() == 0


def test_rewind_decode_goes_back_to_the_prompt_boundary():
    """What the session does before storing: every layer back to the end of its prefill, the
    logs dropped (a stored entry holds max_size slots and nothing more); unwrapped: untouched."""
    data = _data(400, seed=9)
    layers = [PreallocatedRotatingKVCache(128, 4), PreallocatedRotatingKVCache(32, 0)]
    ref = [PreallocatedRotatingKVCache(128, 4), PreallocatedRotatingKVCache(32, 0)]
    _run(layers, [200] + [1] * 12, data)
    _run(ref, [200], data)
    assert layers[0].undo_nbytes() > 0
    assert rewind_decode(layers) == 12
    assert all(_state_equal(a, b) for a, b in zip(layers, ref))
    assert all(c.undo_len() == 0 and c.undo_nbytes() == 0 for c in layers)
    small = [PreallocatedRotatingKVCache(128, 4)]
    _run(small, [50] + [1] * 5, data)
    assert rewind_decode(small) == 0 and small[0].offset == 55  # stock-trimmable: kept whole
