"""Entries of state-space and nested-cache families are stored and reused (they never were).

Mamba's layers are ``ArraysCache`` (a fixed-size recurrent state, no token count) and
Falcon-H1 / DeepSeek-V3.2 nest caches in ``CacheList``; kvplugin read an entry's length only
from a top-level ``offset``, so these entries were never stored while stock reused thousands
of prompt tokens per request.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from kvplugin.cache.layers import entry_tokens
from kvplugin.cache.service.service import KVService
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings


def recurrent(n_layers: int = 3) -> list:
    out = []
    for i in range(n_layers):
        c = ArraysCache(2)
        c[0] = mx.ones((1, 3, 8)) * i
        c[1] = mx.ones((1, 4, 16)) * i
        out.append(c)
    return out


def kv(n: int) -> KVCache:
    c = KVCache()
    k = mx.ones((1, 2, n, 8))
    c.update_and_fetch(k, k)
    return c


def session() -> KVService:
    pm = create_plugin_manager(load_entry_points=False)
    return KVService(resolve_settings(), host="test", hook=pm.hook, max_bytes=1 << 40)


def test_token_count_reads_nested_caches_and_says_unknown_for_pure_state():
    assert entry_tokens(recurrent()) is None
    assert entry_tokens([CacheList(kv(12), ArraysCache(2))]) == 12
    assert entry_tokens([*recurrent(), kv(20)]) == 20  # hybrid: the attention layers count


def test_pure_recurrent_entry_is_stored_and_reused_by_move():
    svc = session()
    prompt = list(range(50))
    assert svc.fetch("m", prompt) == (None, 0)
    cache = recurrent()
    assert svc.give_back("m", prompt, cache)
    assert svc.stats()["entries_stored"] == 1 and len(svc.store) == 1
    got, n = svc.fetch("m", prompt + [7, 8])  # the next turn continues the conversation
    assert n == 50 and got is cache


def test_cache_list_entry_is_stored_with_its_real_length():
    svc = session()
    tokens = list(range(30))
    assert svc.give_back("m", tokens, [CacheList(kv(30), kv(30))])
    got, n = svc.fetch("m", tokens + [1])
    assert n == 30 and isinstance(got[0], CacheList)


def test_a_cache_that_cannot_be_stored_is_counted_and_named(capsys):
    from kvplugin import log

    log.forget()
    svc = session()
    state = ArraysCache(2)  # a layer that neither counts tokens nor can be trimmed...
    layer = kv(40)  # ...next to one holding more tokens than the key: cannot be cut
    assert not svc.give_back("m", list(range(30)), [layer, state])
    stats = svc.stats()
    assert stats["entries_rejected"] == 1
    assert stats["rejected_by_kind"] == {"ArraysCache,KVCache": 1}
    assert "ArraysCache,KVCache layers was not stored" in capsys.readouterr().err
