"""The store evicts in the host's own order where the host gives one (mlx-lm's cache types):
checked against mlx-lm's ``LRUPromptCache.CacheOrder`` itself, and through a real store."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache

from kvplugin.cache.store.order import HOST_ORDER, next_victim
from kvplugin.cache.store.prompt_store import PromptStore
from kvplugin.types import StoreEntry


def test_the_next_victim_is_the_one_mlx_lm_s_cache_order_pops():
    rng = random.Random(0)
    for trial in range(200):
        stock, ours = LRUPromptCache.CacheOrder(), []
        for i in range(rng.randrange(1, 12)):
            kind = rng.choice(HOST_ORDER)
            stock.push("m", (i,), kind)
            ours.append(StoreEntry("m", (i,), [], 0, kind=kind))
        while ours:
            want = stock.pop()[1]
            got = next_victim(ours)
            assert got.tokens == want, (trial, [e.kind for e in ours])
            ours.remove(got)


def test_entries_without_a_kind_are_plain_lru_and_the_insert_s_own_is_never_chosen():
    plain = [StoreEntry("m", (i,), [], 0) for i in range(3)]
    assert next_victim(plain) is plain[0]
    assert next_victim(plain[:1], keep=plain[0]) is None


def _kv(n: int) -> list:
    c = KVCache()
    x = mx.ones((1, 1, n, 4))
    c.update_and_fetch(x, x)
    return [c]


def test_a_full_store_keeps_the_system_prompt_checkpoint_as_stock_does():
    """mlx-lm's batched path stores a system-prompt checkpoint, then user and assistant
    entries: at its entry cap stock evicts assistant turns first, and so does the store."""
    s = PromptStore(max_bytes=1 << 30, max_entries=3)
    system = tuple(range(100, 108))
    s.insert("m", list(system), _kv(8), kind="system")
    for i in range(4):  # other conversations' turns push past the cap
        key = list(range(200 + 10 * i, 206 + 10 * i))
        s.insert("m", key, _kv(6), kind="user" if i % 2 else "assistant")
    kinds = sorted(e.kind for e in s.entries())
    assert "system" in kinds and len(kinds) == 3, kinds
    got, n = s.fetch("m", list(system) + [1])
    assert n == 8
    plain = PromptStore(max_bytes=1 << 30, max_entries=3)  # no kinds: least recently used
    plain.insert("m", list(system), _kv(8))
    for i in range(4):
        plain.insert("m", list(range(200 + 10 * i, 206 + 10 * i)), _kv(6))
    assert plain.fetch("m", list(system) + [1]) == (None, 0)
