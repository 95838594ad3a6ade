"""``kvplugin_cache_event``: called directly, and fired by the session at each cache event.

Why it matters: the memory tracer reads MLX and process memory at these moments; an event
missing or out of order would put a transient at the wrong step of the timeline.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvplugin.cache.service.service import KVService
from kvplugin.hookspecs import hookimpl
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    @hookimpl
    def kvplugin_cache_event(self, event, tokens, nbytes):
        self.seen.append((event, tokens, nbytes))


def entry(n: int, slack: int = 44) -> list:
    out = []
    for i in range(2):
        c = KVCache()
        k = mx.random.normal((1, 2, n + slack, 64), key=mx.random.key(i)).astype(mx.float16)
        c.keys, c.values, c.offset = k, k, n
        out.append(c)
    return out


def make(store: dict | None = None, **flags):
    """A session with an :class:`Events` observer; ``store``: KVService's store limits."""
    pm = create_plugin_manager(load_entry_points=False)
    ev = Events()
    pm.register(ev)
    limits = {"max_bytes": 1 << 40, **(store or {})}
    return KVService(resolve_settings(flags), host="test", hook=pm.hook, **limits), ev, pm


def test_direct_call_reaches_every_implementation():
    _, ev, pm = make()
    pm.hook.kvplugin_cache_event(event="fetch", tokens=3, nbytes=10, seconds=0.0)
    assert ev.seen == [("fetch", 3, 10)]


def test_session_fires_events_in_order_with_sizes():
    svc, ev, _ = make(kv_cache_quantization=True, kv_cache_min_quantize_tokens=0)
    prompt = list(range(300))
    assert svc.fetch("m", prompt) == (None, 0)
    svc.insert("m", prompt, entry(300))
    names = [e[0] for e in ev.seen]
    assert names == ["miss", "trim", "quantize", "store"]
    trim, quant, store = ev.seen[1:]
    assert trim[1] == quant[1] == store[1] == 300
    assert quant[2] < trim[2] and store[2] == quant[2]  # sizes as they are at each step
    ev.seen.clear()
    cache, n = svc.fetch("m", prompt + [1, 2])
    assert n == 300
    assert [e[0] for e in ev.seen] == ["dequantize", "fetch"]
    assert ev.seen[-1][1] == 300 and ev.seen[-1][2] > quant[2]


def test_eviction_is_an_event():
    svc, ev, _ = make({"max_entries": 1})
    svc.insert("m", list(range(10)), entry(10))
    svc.insert("m", list(range(100, 120)), entry(20))
    evicted = [e for e in ev.seen if e[0] == "evict"]
    assert [e[1] for e in evicted] == [10] and evicted[0][2] > 0


def test_a_spill_to_the_cold_tier_is_an_event_after_its_eviction(tmp_path):
    svc, ev, _ = make({"max_entries": 1}, ssd_cache_dir=str(tmp_path))
    svc.insert("m", list(range(10)), entry(10))
    svc.insert("m", list(range(100, 120)), entry(20))
    after = [e for e in ev.seen if e[0] in ("evict", "spill")]
    assert [e[:2] for e in after] == [("evict", 10), ("spill", 10)]
    assert after[1][2] == after[0][2] > 0  # the bytes that left memory
    assert svc.store.stats().spills == 1
    svc.close()
