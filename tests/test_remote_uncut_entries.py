"""Entries that cannot be cut (wrapped ``--max-kv-size`` windows, recurrent state) in the remote
tier, against a real redis-server.

Such an entry serves only prompts that start with all of it, and conversations store several
that end within one block (the system prompt, each conversation's prompt, prompt + reply, in
any order): every one is a candidate at that block's pointer, so another replica finds the one
its prompt extends, whichever was written first; a candidate whose value is gone is removed by
the reader that finds it.
"""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from mlx_lm.models.cache import ArraysCache, KVCache

from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.tiers.remote import RemoteTier
from kvplugin.cache.tiers.remote_keys import PREFIX

BLOCK = 64
MAX = 96
MODEL = "mlx-lm|fp-abc|max_kv=96"


def _wrapped(tokens: int, seed: int) -> list:
    """A bounded layer past its bound: it cannot be cut to a shorter prefix."""
    layer = PreallocatedRotatingKVCache(MAX, 4)
    k = mx.random.normal((1, 2, tokens, 32), key=mx.random.key(seed)).astype(mx.float16)
    layer.update_and_fetch(k, k)
    assert not layer.is_trimmable()
    return [layer]


def _settled(t: RemoteTier, puts: int) -> None:
    deadline = time.monotonic() + 10
    while (s := t.stats())["remote_puts"] < puts or s["remote_queued_bytes"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.01)


def _hybrid(tokens: int, seed: int) -> list:
    """Attention and recurrent layers, as Qwen3-Next has: the state cannot be cut."""
    attention = KVCache()
    k = mx.random.normal((1, 2, tokens, 32), key=mx.random.key(seed)).astype(mx.float16)
    attention.update_and_fetch(k, k)
    state = ArraysCache(2)
    state[0] = mx.random.normal((1, 3, 8), key=mx.random.key(seed + 1))
    state[1] = mx.random.normal((1, 4, 16), key=mx.random.key(seed + 2))
    return [attention, state]


@pytest.mark.parametrize("make", [_wrapped, _hybrid], ids=["wrapped-window", "recurrent"])
def test_an_entry_ending_mid_block_serves_every_prompt_it_starts(tier, make):
    """A's entries are written first and end in the system prompt's block and past it; B
    starts with the system prompt only, so only the system prompt's own entry serves it."""
    a, b = tier(), tier()
    system = list(range(100, 100 + 2 * BLOCK + 27))
    first = system + list(range(900, 920))  # A's prompt: ends in the system prompt's block
    reply = first + list(range(2000, 2050))  # A's prompt + reply: ends a block further
    for n, (tokens, seed) in enumerate([(reply, 1), (first, 2), (system, 3)], start=1):
        assert a.publish(MODEL, tokens, make(len(tokens), seed))
        _settled(a, n)
    got = b.fetch(MODEL, system + [7] * 90)  # B
    assert got is not None and got[1] == len(system)
    got = b.fetch(MODEL, first + [8] * 40)  # A's next turn, re-tokenizing the reply
    assert got is not None and got[1] == len(first)
    got = b.fetch(MODEL, reply + [9] * 5)  # A's next turn, the reply as it was
    assert got is not None and got[1] == len(reply)
    assert b.stats()["remote_hits"] == 3


def test_a_candidate_whose_value_is_gone_is_removed_and_another_serves(tier, redis_server):
    a, b = tier(), tier()
    tokens = list(range(500, 700))
    assert a.publish(MODEL, tokens[:110], _wrapped(110, 2))
    _settled(a, 1)
    client = redis_server.client()
    for key in client.keys(f"{PREFIX}:*:e:*"):  # Redis evicted the value, not its pointer
        client.delete(key)
    assert b.fetch(MODEL, tokens) is None
    assert b.stats()["remote_stale"] == 1
    deadline = time.monotonic() + 10
    while client.keys(f"{PREFIX}:*:p:*"):  # the reader removes it, off the request thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    c = tier()
    assert c.publish(MODEL, tokens[:105], _wrapped(105, 3))
    _settled(c, 1)
    got = b.fetch(MODEL, tokens)
    assert got is not None and got[1] == 105
