"""The pressure policy in the store: full-precision entries are quantized in place (demoted) by
the store's worker, least recently used first and the newest last, before any is evicted; a
request's thread never runs the codec to make room for others, and the store never holds more
than its budget: an entry that does not fit at full precision is quantized as it is stored;
spills are quantized; hits are counted by precision; a fetch never waits for the codec.

Real mlx-lm ``KVCache`` layers and the configured codec (8-bit affine: about 0.53x fp16), on a
:class:`KVService` as the hosts use it.
"""

from __future__ import annotations

import threading

import mlx.core as mx
from kvcaches import filled

from kvplugin.cache.layers import entry_nbytes, layer_bits
from kvplugin.cache.service.service import KVService
from kvplugin.cache.store.prompt_store import PromptStore
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings

T = 64  # tokens per entry
F = 2 * 2 * 2 * T * 64 * 2  # bytes of one trimmed fp16 entry: layers x (K, V) x heads x T x D x 2


def conv(i: int, n: int = T) -> list[int]:
    return list(range(1000 * i, 1000 * i + n))


def service(max_bytes: int, **flags) -> KVService:
    settings = resolve_settings({"kv_cache_quantization_policy": "pressure",
                                 "kv_cache_min_quantize_tokens": 0, **flags})
    pm = create_plugin_manager(load_entry_points=False)
    return KVService(settings, host="test", hook=pm.hook, max_bytes=max_bytes)


def trimmed(n: int) -> list:
    """A filled entry cut to what it holds (as the service stores it)."""
    cache = filled(n)
    for c in cache:
        c.keys, c.values = mx.array(c.keys[..., :n, :]), mx.array(c.values[..., :n, :])
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return cache


def precision(svc: KVService) -> dict[int, str]:
    """Each stored conversation (by its first token // 1000): full or demoted."""
    out = {}
    for e in svc.store.entries():
        quantized = any(layer_bits(layer) is not None for layer in e.cache)
        assert quantized == e.demoted
        out[e.tokens[0] // 1000] = "demoted" if e.demoted else "full"
    return out


def stored(svc: KVService, i: int, n: int = T) -> None:
    """Store conversation ``i`` and let the worker finish what that woke it for."""
    svc.insert("m", conv(i, n), filled(n))
    assert svc.store.settle()


def demotion_order(svc: KVService) -> list[int]:
    """Record the conversations the worker demotes, in order (appended as it goes)."""
    order: list[int] = []
    svc.store.on_demote = lambda tokens, cache, seconds: order.append(tokens[0] // 1000)
    return order


def test_entries_are_stored_at_full_precision_while_they_fit():
    svc = service(10 * F)
    svc.insert("m", conv(1), filled(T))
    (entry,) = svc.store.entries()
    assert entry.nbytes == F and not entry.demoted
    assert all(layer_bits(layer) is None for layer in entry.cache)
    assert svc.stats()["entries_quantized"] == 0 and svc.stats()["demotions"] == 0
    svc.close()


def test_the_least_recently_used_is_demoted_before_anything_is_evicted():
    svc = service(int(3.2 * F))
    for i in (1, 2, 3):
        stored(svc, i)
    st = svc.stats()
    assert precision(svc) == {1: "demoted", 2: "demoted", 3: "full"}
    assert st["store_evictions"] == 0 and st["demotions"] == 2 and st["evictions_full"] == 0
    assert st["bytes_saved_by_demotion"] == 2 * (F - svc.store.entries()[0].nbytes) > 0.8 * F
    assert svc.store.nbytes <= 3.2 * F
    svc.close()


def test_a_conversation_that_just_stored_its_turn_is_demoted_last():
    svc = service(int(3.2 * F))
    order = demotion_order(svc)
    stored(svc, 1)
    stored(svc, 2)
    cache, n = svc.fetch("m", conv(1, T + 1))  # conversation 1's next turn: moved out
    assert n == T
    for c in cache:
        c.update_and_fetch(*(mx.zeros((1, 2, 1, 64), dtype=mx.float16),) * 2)
    svc.insert("m", conv(1, T + 1), cache)  # given back, now the most recent but one
    assert svc.store.settle()
    stored(svc, 3)
    assert order == [2, 1]  # room for the next: the older conversation went first
    assert precision(svc) == {2: "demoted", 1: "demoted", 3: "full"}
    svc.close()


def test_eviction_follows_only_when_every_entry_is_demoted():
    svc = service(int(1.2 * F))
    stored(svc, 1)
    stored(svc, 2)  # no room at full precision beside the first: stored demoted, both kept
    assert precision(svc) == {1: "demoted", 2: "demoted"}
    assert svc.stats()["store_evictions"] == 0
    stored(svc, 3)
    assert precision(svc) == {2: "demoted", 3: "demoted"}
    st = svc.stats()
    assert st["store_evictions"] == 1 and st["evictions_full"] == 0
    assert (st["demotions"], st["demotions_at_insert"]) == (1, 2)
    svc.close()


def test_the_worker_demotes_ahead_of_need_the_newest_entry_only_when_it_must():
    svc = service(int(2.6 * F))  # two entries: no room for a third like them
    stored(svc, 1)
    stored(svc, 2)
    assert precision(svc) == {1: "demoted", 2: "full"}  # room for a third, once demoted
    assert svc.stats()["demotions"] == 1
    svc.close()


def test_the_budget_holds_at_every_insert_and_only_an_entry_that_does_not_fit_is_quantized_there():
    """Conversations taking turns faster than the worker demotes: the store never holds more
    than its budget, not even for a moment; the inserting thread quantizes only the entry it
    stores, and only when the budget cannot hold it at full precision beside the rest (the
    worker demotes everything else)."""
    budget = int(3.2 * F)
    svc = service(budget)
    at_insert: list[int] = []
    demote = svc.store.demote

    def watched(model_key, tokens, cache):
        if threading.current_thread().name != "kvplugin-demote":
            at_insert.append(entry_nbytes(cache))
            assert not svc.store.fits_at_full_precision(model_key, tokens, entry_nbytes(cache))
        return demote(model_key, tokens, cache)

    svc.store.demote = watched
    for turn in range(2):
        for i in range(1, 9):
            svc.insert("m", conv(i, T + turn), filled(T + turn))  # no settle: the worker lags
            assert svc.store.nbytes <= budget
    assert svc.store.settle()
    st = svc.stats()
    assert st["demotions"] >= 1 and st["demotions_at_insert"] == len(at_insert) >= 1
    assert all(n >= F for n in at_insert)  # each the entry being stored, at full precision
    svc.close()


def lazy_copy_insert(svc: KVService, i: int, n: int) -> tuple[int, int]:
    """Insert a lazy copy of ``n`` rows of a live buffer (as mlx-lm's batched path hands its
    entries over); MLX's peak and held memory above what was held before, in bytes."""
    source = filled(4 * n)  # stands in for the live batch
    lazy = filled(n)
    for c, s in zip(lazy, source):
        c.keys, c.values = mx.contiguous(s.keys[..., :n, :]), mx.contiguous(s.values[..., :n, :])
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    svc.insert("m", conv(i, n), lazy)
    lazy = None
    return mx.get_peak_memory() - base, mx.get_active_memory() - base


def test_an_entry_that_does_not_fit_costs_what_always_costs_to_store_it():
    """A lazy copy the budget cannot hold at full precision is quantized from its rows as it
    is stored, as ``always`` stores it: no full-precision copy stays beside its source."""
    n = 256  # a whole growth step: the entry is exact
    f = entry_nbytes(filled(n))
    pressure = service(int(1.2 * f))
    pressure.insert("m", conv(1, n), filled(n))
    assert pressure.store.settle()  # the first, demoted: no room for a second at full precision
    always = service(int(1.2 * f), kv_cache_quantization_policy="always")
    always.insert("m", conv(1, n), filled(n))
    peak, held = lazy_copy_insert(pressure, 2, n)
    always_peak, always_held = lazy_copy_insert(always, 2, n)
    assert precision(pressure) == {1: "demoted", 2: "demoted"}
    assert pressure.stats()["demotions_at_insert"] == 1
    assert held <= always_held + f // 8 and peak <= always_peak + f // 8
    pressure.close()
    always.close()


def test_the_store_never_exceeds_its_budget_once_the_worker_keeps_up():
    budget = int(3.2 * F)
    svc = service(budget)
    for turn in range(2):
        for i in range(1, 7):
            stored(svc, i, T + turn)
            assert svc.store.nbytes <= budget
    st = svc.stats()
    assert st["evictions_full"] == 0 and st["demotions"] > 0
    svc.close()


def test_hits_are_counted_by_precision_and_a_demoted_hit_is_restored():
    svc = service(int(2.6 * F))
    original = filled(T)
    want = [mx.array(c.keys[..., :T, :]) for c in original]
    svc.insert("m", conv(1), original)
    stored(svc, 2)
    assert precision(svc) == {1: "demoted", 2: "full"}
    full, n = svc.fetch("m", conv(2, T + 5))
    assert n == T and all(layer_bits(c) is None for c in full)
    restored, n = svc.fetch("m", conv(1, T + 5))
    assert n == T and all(layer_bits(c) is None for c in restored)
    for c, k in zip(restored, want):
        assert mx.abs(c.keys[..., :T, :] - k).max().item() < 0.05  # 8-bit affine
    st = svc.stats()
    assert (st["hits_full"], st["hits_demoted"]) == (1, 1)
    svc.close()


def test_a_spill_writes_the_quantized_form(tmp_path):
    svc = service(10 * F, ssd_cache_dir=str(tmp_path))
    svc.store.max_entries = 1  # an entry-count eviction: demoting makes no room for it
    svc.insert("m", conv(1), filled(T))
    svc.insert("m", conv(2), filled(T))
    st = svc.stats()
    assert st["store_spills"] == 1 and st["demotions"] == 0 and st["evictions_full"] == 1
    assert 0 < st["store_cold_bytes"] < 0.6 * F  # quantized on its way out
    cache, n = svc.fetch("m", conv(1, T + 1))
    assert n == T and all(layer_bits(c) is None for c in cache)  # restored as any hit
    svc.close()


def test_admission_evicts_at_once_without_running_the_codec():
    svc = service(10 * F)
    for i in (1, 2):
        svc.insert("m", conv(i), filled(T))
    svc.store.trim_to(n_bytes=int(1.6 * F))
    assert precision(svc) == {2: "full"}
    st = svc.stats()
    assert st["store_evictions"] == st["evictions_full"] == 1 and st["demotions"] == 0
    svc.close()


def test_a_fetch_never_waits_for_the_codec_and_a_moved_entry_is_not_swapped():
    """The entry stays stored while the codec works on its copy: a hit meanwhile is a
    full-precision move, and the demotion's result is dropped."""
    started, release = threading.Event(), threading.Event()

    def slow_demote(model_key, tokens, cache):
        started.set()
        assert release.wait(10)
        return [layer for layer in cache]  # stands in for a codec: any list

    store = PromptStore(max_bytes=int(1.5 * F), demote=slow_demote)
    store.insert("m", conv(1), trimmed(T))  # above the high-water mark: the worker starts
    assert started.wait(10)
    cache, n = store.fetch("m", conv(1, T + 1))  # answered while the codec is held
    assert n == T and cache is not None and entry_nbytes(cache) == F
    release.set()
    assert store.settle()
    assert store.stats().demotions == 0 and store.entries() == []
    store.close()


def test_the_worker_keeps_room_for_the_next_entry_so_inserts_do_not_evict():
    svc = service(int(3.2 * F))
    for i in range(1, 5):  # the fourth fits only because the worker made room for it
        stored(svc, i)
    st = svc.stats()
    assert st["store_evictions"] == 0 and len(svc.store) == 4
    assert st["demotions"] == 4  # all ahead of need, the newest last: room for a fifth
    assert svc.store.nbytes + F <= 3.2 * F
    svc.close()


def test_the_hosts_list_lets_go_of_the_layers_a_demotion_replaces():
    """A host may keep the list it inserted (mlx-lm's loop variable): it is emptied at insert,
    so the full-precision layers go when the worker swaps them, not at the host's next turn."""
    svc = service(int(1.5 * F))
    host_list = filled(T)
    layers = list(host_list)
    svc.insert("m", conv(1), host_list)
    assert host_list == []  # the store holds the layers in a list of its own
    assert svc.store.settle()
    (entry,) = svc.store.entries()
    assert entry.demoted and not any(layer in entry.cache for layer in layers)
    svc.close()


def test_a_turn_quantized_at_insert_copies_the_rows_of_its_demoted_entry(monkeypatch):
    """A conversation whose last turn was a hit on a demoted entry: its next entry, which the
    budget cannot hold at full precision, copies that entry's quantized rows (the lent
    snapshot) instead of quantizing the whole conversation again, as ``always`` does."""
    from kvplugin.cache.codec import quantize as codec

    reused: list[int] = []
    real = codec._reusable_rows
    monkeypatch.setattr(codec, "_reusable_rows",
                        lambda *a, **k: reused.append(real(*a, **k)) or reused[-1])
    n = 256
    f = entry_nbytes(filled(n))
    svc = service(int(1.2 * f))
    stored(svc, 1, n)  # demoted by the worker: no room for another at full precision
    svc.insert("m", conv(2, n), filled(n))  # quantized at insert
    assert precision(svc) == {1: "demoted", 2: "demoted"}
    hit, got = svc.fetch("m", conv(1, n + 8))
    assert got == n and svc.stats()["hits_demoted"] == 1
    reused.clear()
    svc.insert("m", conv(1, n + 8), filled(n + 8))  # the turn: over budget at full precision
    st = svc.stats()
    assert st["demotions_at_insert"] == 2 and precision(svc)[1] == "demoted"
    assert reused and min(reused) == n, reused  # every layer copied the n stored rows
    svc.close()
