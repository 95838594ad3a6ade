"""Entries held in memory only between requests (mlx-openai-server, whose stock holds none).

Why it matters: an entry held beside a running request raises the process's peak above
stock's, whose entries are all files; the conversation that just ended must still be a move.
Real KVService, real store, real SSD tier in a temporary directory.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvplugin.cache.service.service import KVService
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings


def entry(n: int, seed: int) -> list:
    out = []
    for i in range(2):
        c = KVCache()
        k = mx.random.normal((1, 2, n, 64), key=mx.random.key(seed * 10 + i)).astype(mx.float16)
        c.keys, c.values, c.offset = k, k + 1, n
        out.append(c)
    mx.eval([x for c in out for x in (c.keys, c.values)])
    return out


def service(tmp_path) -> KVService:
    svc = KVService(resolve_settings({"ssd_cache_dir": tmp_path}), host="test",
                    hook=create_plugin_manager(load_entry_points=False).hook)
    svc.evaluate_at_store = True
    svc.hold_between_requests()
    return svc


def turn(svc: KVService, rid: str, tokens: list[int], seed: int) -> int:
    """One request alone: started, fetched, its cache given back, done; tokens reused."""
    svc.request_started(rid)
    cache, n = svc.fetch("m", tokens)
    svc.give_back("m", tokens, entry(len(tokens), seed) if cache is None else cache)
    svc.request_done(rid)
    return n


def test_the_conversation_that_ended_stays_in_memory_until_another_request(tmp_path):
    svc = service(tmp_path)
    a, b = list(range(100)), list(range(500, 600))
    turn(svc, "r1", a, 1)
    assert svc.store.stats().entries == 1  # held between requests
    svc.request_started("r2")
    assert svc.fetch("m", b) == (None, 0)
    # b's prefill has not allocated anything yet, and a is already a file
    assert svc.store.stats().entries == 0 and svc.store.stats().bytes == 0
    assert svc.store.stats().spills == 1
    svc.give_back("m", b, entry(len(b), 2))
    svc.request_done("r2")
    hits_before = svc.store.stats().hits
    svc.request_started("r3")
    cache, n = svc.fetch("m", [*b, 7])  # the same conversation again: a move, no file read
    assert n == len(b) and svc.store.stats().hits == hits_before + 1
    assert svc.store.stats().cold_hits == 0
    svc.give_back("m", [*b, 7], cache)
    svc.request_done("r3")
    assert turn(svc, "r4", [*a, 9], 1) == len(a)  # a, from its file
    assert svc.store.stats().cold_hits == 1
    svc.close()


def test_an_entry_that_ends_beside_a_running_request_goes_to_the_files(tmp_path):
    svc = service(tmp_path)
    a, b = list(range(100)), list(range(500, 600))
    svc.request_started("ra")
    svc.request_started("rb")
    assert svc.fetch("m", a) == (None, 0)
    assert svc.fetch("m", b) == (None, 0)
    svc.give_back("m", a, entry(len(a), 1))  # b still runs: a must not stay in memory
    assert svc.store.stats().entries == 0 and svc.store.stats().bytes == 0
    svc.request_done("ra")
    svc.give_back("m", b, entry(len(b), 2))  # b ends alone: held
    svc.request_done("rb")
    assert svc.store.stats().entries == 1
    assert turn(svc, "rc", [*a, 3], 1) == len(a)
    svc.close()


def test_without_it_entries_stay_in_memory(tmp_path):
    svc = KVService(resolve_settings({"ssd_cache_dir": tmp_path}), host="test",
                    hook=create_plugin_manager(load_entry_points=False).hook)
    for i, rid in enumerate(("r1", "r2")):
        turn(svc, rid, list(range(i * 1000, i * 1000 + 100)), i)
    assert svc.store.stats().entries == 2 and svc.store.stats().spills == 0
    svc.close()
