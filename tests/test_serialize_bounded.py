"""Bounded entries (``--max-kv-size``: ``PreallocatedRotatingKVCache``) through the cold tiers'
format.

A restored layer, from a file (a restarted server) or a Redis value (another replica), must
continue exactly as the stored one would: same attention outputs, bit for bit, with its kept
first tokens intact.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvplugin.cache.layers import can_copy_prefix, copy_prefix
from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache, rewind_decode
from kvplugin.cache.tiers.remote_wire import decode, encode, seal
from kvplugin.cache.tiers.ssd import SSDTier

H, D = 2, 32
MAX, KEEP = 64, 4
DT = mx.float16
MODEL = "mlx-lm|fp|max_kv=64"


def _qkv(n: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    q, k, v = (mx.random.normal((1, H, n, D), key=mx.random.key(seed * 3 + i)).astype(DT)
               for i in range(3))
    mx.eval(q, k, v)
    return q, k, v


def _step(cache, q, k, v) -> mx.array:
    """One model-style attention step: the mask from the cache before the update, then SDPA."""
    mask = cache.make_mask(k.shape[2], return_array=False)
    keys, values = cache.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)


def _feed(cache, schedule: list[int], seed: int) -> list[mx.array]:
    q, k, v = _qkv(sum(schedule), seed)
    outs, t = [], 0
    for n in schedule:
        outs.append(_step(cache, q[..., t:t + n, :], k[..., t:t + n, :], v[..., t:t + n, :]))
        mx.eval(outs[-1])
        t += n
    return outs


def _bounded(prefill: int, decode_steps: int) -> PreallocatedRotatingKVCache:
    cache = PreallocatedRotatingKVCache(MAX, KEEP, index=1, layers=3)  # a staggered layer
    _feed(cache, [prefill] + [1] * decode_steps, seed=0)
    return cache


def _via_ssd(tmp_path, tokens: list[int], cache: list) -> list:
    assert SSDTier(tmp_path, 1 << 30).put(MODEL, tokens, cache)
    got = SSDTier(tmp_path, 1 << 30).fetch(MODEL, tokens + [7, 8])  # a restarted server
    assert got is not None and got[1] == len(tokens)
    return got[0]


def _via_wire(tmp_path, tokens: list[int], cache: list) -> list:
    buf, _ = encode("ns", tokens, cache)
    held, restored, _ = decode(bytes(seal(buf)), "ns", 1 << 30)
    assert list(held) == tokens
    return restored


@pytest.mark.parametrize("via", [_via_ssd, _via_wire], ids=["ssd-file", "redis-value"])
@pytest.mark.parametrize("prefill,decode_steps,rewind", [
    (40, 5, False),   # never wrapped: trimmable, stored exact-size
    (100, 30, True),  # wrapped, rewound to its prompt boundary as every stored entry is
    (100, 30, False),  # wrapped with a live undo log: the log is not stored
], ids=["unwrapped", "wrapped", "wrapped-live-log"])
def test_a_restored_bounded_layer_continues_exactly_as_the_stored_one(
        tmp_path, via, prefill, decode_steps, rewind):
    stored = _bounded(prefill, decode_steps)
    if rewind:
        assert rewind_decode([stored]) == decode_steps
    held = stored.offset
    keys_before = mx.array(stored.keys)
    restored = via(tmp_path, list(range(1, held + 1)), [stored])[0]

    assert type(restored) is PreallocatedRotatingKVCache
    assert (restored.offset, restored._idx, restored.keep, restored.max_size) == (
        stored.offset, stored._idx, KEEP, MAX)
    assert (restored._layers, restored._phase) == (stored._layers, stored._phase)
    assert restored.undo_len() == 0  # the log stays with the request that wrote it
    assert mx.array_equal(restored.keys[..., :KEEP, :], keys_before[..., :KEEP, :])
    assert restored.is_trimmable() == (held < MAX)
    # the same continuation for both: decode steps, a chunk that wraps, more decode steps
    schedule = [1] * 9 + [70] + [1] * 12
    want = _feed(stored, schedule, seed=5)
    got = _feed(restored, schedule, seed=5)
    for i, (a, b) in enumerate(zip(want, got)):
        assert mx.array_equal(a, b), f"step {i} differs"
    assert mx.array_equal(restored.keys[..., :KEEP, :], keys_before[..., :KEEP, :])


def test_an_unwrapped_bounded_entry_with_a_live_log_serves_its_prefixes():
    """The undo log does not make a bounded entry's prefix uncopyable (the hot tier's shared
    prefixes, and the cold tiers' ``trimmable`` flag)."""
    cache = _bounded(30, 10)
    assert cache.undo_len() == 10
    assert can_copy_prefix([cache], 20)
    copy = copy_prefix([cache], 20)
    assert copy is not None and copy[0].offset == 20 and copy[0].undo_len() == 0
    assert cache.undo_len() == 10  # the source's log is its own
    assert mx.array_equal(copy[0].keys, cache.keys[..., :20, :])
