"""Precision as a tier: under pressure the store quantizes its coldest full-precision entries in
place (demotes them) before it evicts any.

Why: quantizing every entry as it is stored makes each turn of the active conversation pay a
quantize and a restore even when memory is plentiful. With the ``pressure`` policy entries are
stored at full precision, and only the bytes the budget cannot hold are bought back by the codec:
least recently used first (the entry a conversation just stored last), ahead of need on a worker
thread once the hot tier passes :data:`HIGH_WATER` of its budget or leaves no room for another
entry like the last one. The hot tier never holds more than its budget: an entry enters at full
precision only where the budget holds it beside what is stored (:meth:`fits_at_full_precision`);
one that does not (every other entry demoted already, or the worker still at work) is
quantized as it is stored (:meth:`demote_at_insert`, as ``always`` stores every entry) rather
than held at full precision over the budget, where a batched host's copy would sit beside the
live batch it was cut from.
Admission evicts what it lacks at once; a full-precision entry evicted so is counted
(``evictions_full``). The codec is the caller's ``demote`` callable: the store imports none.

A fetch is never blocked behind the codec: the entry stays stored while its copy is quantized,
and the quantized layers replace it only if it is still stored then (a hit in the meantime is a
full-precision move, and the work is dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvplugin.cache.layers import entry_nbytes, layer_bits
from kvplugin.cache.store.index import to_key

__all__ = ["Demote", "Demotion", "HIGH_WATER", "OnDemote"]

log = logging.getLogger("kvplugin.cache")

#: The share of the byte budget above which the worker thread demotes ahead of need; it also
#: keeps room for one more entry as large as the last one stored, whichever asks more, so the
#: next insert finds room without evicting.
HIGH_WATER = 0.85

#: ``demote(model_key, tokens, cache[, stored_prefix]) -> quantized cache | None`` (None: keep
#: it as it is). The cache list is the store's copy: the callable may consume it, not the
#: layers' arrays. ``stored_prefix``: rows the codec may copy (a conversation's stored entry).
Demote = Callable[..., "list | None"]
#: ``on_demote(tokens, cache, seconds)``: the worker demoted an entry, its codec taking ``seconds``.
OnDemote = Callable[[Sequence[int], list, float], None]

DEMOTION_COUNTERS = ("demotions", "demotions_at_insert", "evictions_full",
                     "bytes_saved_by_demotion", "hits_full", "hits_demoted")


class Demotion:
    """The demotion half of :class:`~kvplugin.cache.store.prompt_store.PromptStore` (a mixin:
    it works on the store's lock, index, owners and counters)."""

    def _init_demotion(self, demote: Demote | None, on_demote: OnDemote | None) -> None:
        self.demote = demote
        self.on_demote = on_demote
        self._wake = threading.Event()
        self._idle = threading.Event()  # the worker has nothing left to do
        self._idle.set()
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._last_price = 0  # the last full-precision entry's bytes: the room the worker keeps
        self._c.update(dict.fromkeys(DEMOTION_COUNTERS, 0))

    def _new_entry_precision(self, entry: Any, *, inserted: bool = True,
                             demoted: bool = False) -> None:
        """Under the lock, as an entry is stored: whether it is a candidate for demotion."""
        entry.demoted = demoted
        entry.demotable = self.demote is not None and all(
            layer_bits(layer) is None for layer in entry.cache)
        if inserted and entry.demotable:
            self._last_price = entry.nbytes

    def fits_at_full_precision(self, model_key: Any, tokens: Sequence[int], nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` at full precision fits the budget beside what is
        stored (less the shorter entries of its conversation it supersedes), evicting nothing."""
        with self._lock:
            held = self._index.nbytes - sum(
                e.nbytes for _, e in self._index.prefixes_of(model_key, to_key(tokens)))
            return held + nbytes <= self.max_bytes

    def above_high_water(self, nbytes: int) -> bool:
        """Whether storing ``nbytes`` more would put the hot tier above its high-water mark
        (the worker will demote to make room again)."""
        with self._lock:
            return self._index.nbytes + nbytes > self._high_water()

    def demote_at_insert(self, model_key: Any, tokens: Sequence[int], cache: list,
                         stored_prefix: list | None = None) -> list | None:
        """``cache`` quantized on the caller's thread, an entry the budget cannot hold at full
        precision (None: the codec declined or failed). The codec consumes ``cache`` itself,
        so each full-precision layer goes as soon as its quantized one is made, and copies
        the rows ``stored_prefix`` (the conversation's entry as stored) holds already."""
        before = entry_nbytes(cache)
        try:
            demoted = (self.demote(model_key, tokens, cache) if stored_prefix is None
                       else self.demote(model_key, tokens, cache, stored_prefix))
        except Exception:
            log.exception("kvplugin: quantizing an entry to store failed; stored as it is")
            demoted = None
        if not demoted:
            return None
        with self._lock:
            self._c["demotions_at_insert"] += 1
            self._c["bytes_saved_by_demotion"] += before - entry_nbytes(demoted)
        return demoted

    def _high_water(self) -> float:
        """Under the lock: the bytes above which the worker demotes ahead of need: room for the
        next request's cache at full precision, as its insert lands and as a batched host's
        admission counts its live cache against the budget."""
        return max(0.0, min(HIGH_WATER * self.max_bytes, self.max_bytes - self._last_price))

    def _count_hit_precision(self, entry: Any) -> None:
        """Under the lock: a hot hit, by the precision it was served from."""
        if entry.demoted:
            self._c["hits_demoted"] += 1
        elif all(layer_bits(layer) is None for layer in entry.cache):
            self._c["hits_full"] += 1

    def _demote_one(self) -> bool:
        """On the worker: demote the least recently used candidate, the newest entry last
        (False: none is left). The codec runs outside the store lock."""
        with self._lock:
            entry = next((e for e in self._index if e.demotable), None)
            if entry is None:
                return False
            entry.demotable = False  # in flight: tried once
            model_key, tokens, cache = entry.model_key, entry.tokens, list(entry.cache)
        start = time.perf_counter()
        try:
            demoted = self.demote(model_key, tokens, cache)
        except Exception:
            log.exception("kvplugin: demoting an entry failed; it stays at full precision")
            demoted = None
        seconds = time.perf_counter() - start
        cache = None
        with self._lock:
            if not demoted or self._index.get(model_key, tokens) is not entry:
                return True  # nothing to demote, or a hit or an eviction took it meanwhile
            before, first = entry.nbytes, id(entry.cache[0])
            self._index.reprice(entry, lambda e: _swap(e, demoted))
            if self._owner.get(first) is entry:
                del self._owner[first]
            self._owner[id(demoted[0])] = entry
            self._c["demotions"] += 1
            self._c["bytes_saved_by_demotion"] += before - entry.nbytes
        if self.after_evictions is not None:  # the full-precision layers are let go only now
            try:
                self.after_evictions()
            except Exception:
                log.exception("kvplugin: after_evictions hook failed")
        if self.on_demote is not None:
            try:
                self.on_demote(tokens, demoted, seconds)
            except Exception:
                log.exception("kvplugin: on_demote hook failed")
        return True

    def _make_room(self, n_bytes: int, n_entries: int | None, keep: Any = None) -> list:
        """Under the lock: evict what does not fit beside ``keep`` (the entry an insert stores;
        returned, to dispose of outside it), then wake the worker if the hot tier is above the
        high-water mark."""
        evicted = self._evict_until(n_bytes, 1 << 62 if n_entries is None else n_entries,
                                    keep=keep)
        self._c["evictions_full"] += sum(1 for e in evicted if e.demotable)
        if self.demote is not None and self._index.nbytes > self._high_water():
            self._nudge()
        return evicted

    def _spill_form(self, model_key: Any, tokens: Sequence[int], cache: list,
                    demotable: bool) -> list:
        """What a spill writes: under the pressure policy a full-precision entry quantized,
        so the cold tiers hold what a demoted entry holds."""
        if not demotable or self.demote is None:
            return cache
        try:
            return self.demote(model_key, tokens, list(cache)) or cache
        except Exception:
            log.exception("kvplugin: quantizing an entry to spill failed; spilled as it is")
            return cache

    def _nudge(self) -> None:
        """Wake the worker (started on first need) to demote ahead of need."""
        with self._lock:
            if self._stopping:
                return
            self._idle.clear()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, daemon=True,
                                                name="kvplugin-demote")
                self._worker.start()
            self._wake.set()

    def _work(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while not self._stopping:
                with self._lock:
                    high = self._index.nbytes > self._high_water()
                if not high or not self._demote_one():
                    break
            with self._lock:
                if not self._wake.is_set():
                    self._idle.set()
            if self._stopping:
                return

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until the worker has demoted what it was woken for (True: it has)."""
        return self._idle.wait(timeout)

    def _stop_demotion(self) -> None:
        """Stop the worker (shut-down): a pass in flight finishes first."""
        self._stopping = True
        self._wake.set()
        self._idle.set()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=30)


def _swap(entry: Any, cache: list) -> None:
    entry.cache, entry.nbytes, entry.demoted = cache, entry_nbytes(cache), True
