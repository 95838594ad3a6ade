"""The remote tier reads the stored entry the hot tier would choose, against a real redis-server.

A block's pointer set names every recent entry that reaches it; the reader knows from the
members alone how many tokens each shares with the prompt and which can be cut there, so it
reads the one that serves most: the entry sharing the most tokens rather than the newest, a
whole entry over an equal cut of a longer one, a chunked entry only where it can be cut.
"""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ChunkedKVCache, KVCache

from kvplugin.cache.tiers.remote import RemoteTier
from kvplugin.cache.tiers.remote_keys import FAN_OUT, PREFIX, Namespace

BLOCK = 64
MODEL = "mlx-lm|fp-abc|max_kv=0"
SYSTEM = list(range(100, 100 + 2 * BLOCK + 27))  # ends inside the third block


def _entry(tokens: int, seed: int = 0) -> list:
    layer = KVCache()
    k = mx.random.normal((1, 2, tokens, 32), key=mx.random.key(seed)).astype(mx.float16)
    layer.update_and_fetch(k, k)
    return [layer]


def _chunked(tokens: int, seed: int, trim_front: bool) -> list:
    """A chunked-attention layer (Llama 4); trimmed at its front, it can be cut only from
    the first chunk boundary at or after what it still holds."""
    layer = ChunkedKVCache(BLOCK)
    k = mx.random.normal((1, 2, tokens, 32), key=mx.random.key(seed)).astype(mx.float16)
    layer.update_and_fetch(k, k)
    if trim_front:
        layer.maybe_trim_front()
    return [layer]


def _publish(t: RemoteTier, *entries: tuple[list, list]) -> None:
    """Publish in order, each written before the next (so later ones are newer)."""
    for tokens, cache in entries:
        puts = t.stats()["remote_puts"]
        assert t.publish(MODEL, tokens, cache)
        deadline = time.monotonic() + 10
        while t.stats()["remote_puts"] <= puts or t.stats()["remote_queued_bytes"]:
            assert time.monotonic() < deadline, t.stats()
            time.sleep(0.01)
        time.sleep(0.002)  # distinct times in the pointer sets


def test_an_extension_gets_the_entry_sharing_most_not_the_newest(tier):
    """A's turns and B's prompt all leave the system prompt inside its last block, so that
    block's pointer is the deepest for them all."""
    a, b = tier(), tier()
    turn2 = SYSTEM + list(range(1000, 1012))  # A's second prompt (a whole prefix of turn 3)
    replied = turn2 + list(range(3000, 3020))  # ... + the reply, re-tokenized from 3015 on
    other = SYSTEM + list(range(5000, 5060))  # B: written last
    _publish(a, (SYSTEM, _entry(len(SYSTEM), 1)), (turn2, _entry(len(turn2), 2)),
             (replied, _entry(len(replied), 3)), (other, _entry(len(other), 4)))
    turn3 = replied[:-5] + [7, 7, 7] + list(range(6000, 6020))
    got = b.fetch(MODEL, turn3)
    assert got is not None and got[1] == len(replied) - 5  # the reply's entry, cut
    want = _entry(len(replied), 3)[0].keys[..., :got[1], :]
    assert mx.array_equal(got[0][0].keys[..., :got[1], :], want).item()
    # a hot hit as long: nothing more to give, nothing read
    assert b.fetch(MODEL, turn3, have=len(replied) - 5) is None
    assert b.stats()["remote_bytes_read"] < 2 * len(replied) * 2 * 32 * 2 * 2  # one value read


def test_a_whole_entry_beats_an_equal_cut_of_a_longer_one(tier):
    a, b = tier(), tier()
    longer = SYSTEM + list(range(1000, 1200))
    _publish(a, (SYSTEM, _entry(len(SYSTEM), 1)), (longer, _entry(len(longer), 2)))
    got = b.fetch(MODEL, SYSTEM + [9] * 30)
    assert got is not None and got[1] == len(SYSTEM)
    n = len(SYSTEM)
    assert mx.array_equal(got[0][0].keys[..., :n, :], _entry(n, 1)[0].keys[..., :n, :]).item()
    assert b.stats()["remote_bytes_read"] < len(longer) * 2 * 32 * 2 * 2  # not the longer one


# Llama 4, the only model with chunked layers, is served from mlx-lm 0.32.0 on; the entry
# below is trimmed at its front by that version's ChunkedKVCache.
@pytest.mark.host_version("mlx-lm", ">=0.32.0")
def test_a_chunked_entry_is_cut_only_where_it_can_be(tier):
    a, b = tier(), tier()
    early = SYSTEM + list(range(1000, 1100))
    late = SYSTEM + list(range(3000, 3200))  # newer, and trimmed at its front
    cut = _chunked(len(late), 2, trim_front=True)
    floor = -(-cut[0].start_position // BLOCK) * BLOCK
    _publish(a, (early, _chunked(len(early), 1, trim_front=False)), (late, cut))
    prompt = late[:floor - 20] + [7] * 30  # shares most with ``late``, below its floor
    got = b.fetch(MODEL, prompt)
    assert got is not None and got[1] == len(SYSTEM)  # so ``early`` serves the system prompt
    assert isinstance(got[0][0], ChunkedKVCache) and got[0][0].start_position == 0
    got = b.fetch(MODEL, late[:floor + 5] + [7] * 30)  # at or past its floor ``late`` serves
    assert got is not None and got[1] == floor + 5
    assert b.stats()["remote_hits"] == 2 and b.stats()["remote_misses"] == 0


def test_a_pointer_set_keeps_the_newest_few_and_a_hit_keeps_what_it_used(tier, redis_server):
    a, b = tier(ttl_s=600), tier(ttl_s=600)
    many = [SYSTEM + [i] * 40 for i in range(FAN_OUT + 3)]
    _publish(a, *[(tokens, _entry(len(tokens), i)) for i, tokens in enumerate(many)])
    r = redis_server.client()
    ns = Namespace(MODEL, "full", BLOCK)
    shared = ns.pointer_keys(SYSTEM)
    assert [r.zcard(p) for _, p in shared] == [FAN_OUT] * 2  # bounded: the oldest left
    for key in r.keys(f"{PREFIX}:*"):
        r.expire(key, 30)  # as if written long ago
    got = b.fetch(MODEL, many[-1] + [5] * 10)
    assert got is not None and got[1] == len(many[-1])
    deadline = time.monotonic() + 10
    used = [ns.entry_key(many[-1]), *(p for _, p in ns.pointer_keys(many[-1]))]
    while min(r.ttl(k) for k in used) < 500:  # refreshed by the writer, off the request
        assert time.monotonic() < deadline, [r.ttl(k) for k in used]
        time.sleep(0.01)
    assert r.ttl(ns.entry_key(many[0])) <= 30  # what nobody used is left to expire
    got = b.fetch(MODEL, many[0] + [5] * 10)  # the oldest: still named at its last block end
    assert got is not None and got[1] == len(many[0])


def test_a_member_not_of_this_layout_is_ignored(tier, redis_server):
    a, b = tier(), tier()
    _publish(a, (SYSTEM, _entry(len(SYSTEM), 1)))
    r = redis_server.client()
    ns = Namespace(MODEL, "full", BLOCK)
    last = ns.pointer_keys(SYSTEM)[-1][1]
    (real,) = r.zrange(last, 0, -1)
    for junk in (b"junk", real[:-4], real + b"\0\0\0\0", real[:20] + b"\xff" * 4 + real[24:]):
        r.zadd(last, {junk: time.time() + 100})  # newer than the real one
    got = b.fetch(MODEL, SYSTEM + [3] * 10)
    assert got is not None and got[1] == len(SYSTEM)
    assert b.stats()["remote_corrupt"] == 0


def test_fingerprints_that_collide_are_caught_by_the_entry_name(tier):
    """A prompt whose token differs from a whole-only entry's by 256 (the same fingerprint):
    the entry's name, a hash of its tokens, says it is no prefix; nothing is read."""
    from mlx_lm.models.cache import ArraysCache

    a, b = tier(), tier()
    state = ArraysCache(1)
    state[0] = mx.ones((1, 3, 8))
    _publish(a, (SYSTEM, [*_entry(len(SYSTEM), 1), state]))
    prompt = SYSTEM[:-1] + [SYSTEM[-1] + 256] + [4] * 20
    assert b.fetch(MODEL, prompt) is None
    assert b.stats()["remote_bytes_read"] == 0
    got = b.fetch(MODEL, SYSTEM + [4] * 20)
    assert got is not None and got[1] == len(SYSTEM)
