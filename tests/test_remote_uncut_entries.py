"""Entries that cannot be cut (wrapped ``--max-kv-size`` windows, recurrent state) in the remote
tier, against a real redis-server.

Such an entry serves only prompts that extend it whole, and one conversation stores several
that end within one block (its system prompt, its prompt, prompt + reply): the first to claim
a pointer keeps it, so another replica's next turn still finds one it extends; a pointer whose
value is gone is deleted by the reader that finds it, so the next entry can claim it.
"""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.tiers.remote import RemoteTier
from kvplugin.tools.redisproc import RedisServer

BLOCK = 64
MAX = 96
MODEL = "mlx-lm|fp-abc|max_kv=96"


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def tier(redis_server):
    redis_server.client().flushall()
    made = []

    def make() -> RemoteTier:
        t = RemoteTier(redis_server.url, entry_format="full", block_tokens=BLOCK,
                       fetch_timeout_ms=2000)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


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


def test_the_first_uncut_entry_at_a_pointer_keeps_it(tier):
    a, b = tier(), tier()
    conversation = list(range(100, 300))
    prompt, reply = conversation[:110], conversation[110:118]  # both end in block 1
    assert a.publish(MODEL, prompt, _wrapped(110, 0))
    assert a.publish(MODEL, prompt + reply, _wrapped(118, 1))
    _settled(a, 2)
    # the next turn re-tokenizes the reply differently: it extends the prompt, not the reply
    got = b.fetch(MODEL, prompt + [7] * 40)
    assert got is not None and got[1] == 110
    assert b.stats()["remote_hits"] == 1


def test_a_pointer_whose_value_is_gone_is_freed_for_the_next_entry(tier, redis_server):
    a, b = tier(), tier()
    tokens = list(range(500, 700))
    assert a.publish(MODEL, tokens[:110], _wrapped(110, 2))
    _settled(a, 1)
    client = redis_server.client()
    for key in client.keys("kvp1:*:e:*"):  # Redis evicted the value, not its pointer
        client.delete(key)
    assert b.fetch(MODEL, tokens) is None
    assert b.stats()["remote_stale"] == 1
    deadline = time.monotonic() + 10
    while client.keys("kvp1:*:p:*"):  # the reader deletes it, off the request thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    c = tier()
    assert c.publish(MODEL, tokens[:120], _wrapped(120, 3))
    _settled(c, 1)
    got = b.fetch(MODEL, tokens)
    assert got is not None and got[1] == 120
