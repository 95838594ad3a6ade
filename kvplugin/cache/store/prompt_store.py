"""The tiered prompt store: a RAM hot tier with move-on-fetch, in front of a pluggable cold tier.

Why it exists: stock mlx-lm deep-copies an entry on every hit and keeps one copy per turn of a
conversation; the store hands the entry itself to the request (a move), keeps one entry per
conversation, and spills what it evicts to a cold tier instead of dropping it.

In short (the whole specification is ``docs/store.md``): an entry is a host cache keyed by
``(model_key, tokens)``, priced by its bytes; the budget and entry count hold after every insert
(evicting in the host's order, :mod:`kvplugin.cache.store.order`). ``fetch`` gives the longest
stored prefix (moved out), else a copy of a longer entry's shared prefix (views), else a copy of
an entry lent to a request in flight, else asks the cold tier; one token is always left to feed.
``insert`` takes ownership; a longer entry supersedes a shorter one only if it can give every
prefix that one could. Evictions go to ``on_evict``, then to the cold tier (any
:class:`kvplugin.types.ColdTier`, never imported here), outside the lock; with a ``demote``
callable (the pressure policy) a worker quantizes entries in place ahead of need
(:mod:`kvplugin.cache.store.demotion`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvplugin.cache.store.demotion import Demote, Demotion, OnDemote
from kvplugin.cache.store.index import KeyIndex, to_key
from kvplugin.cache.layers import (can_copy_prefix, copy_floor, copy_lent, copy_prefix,
                                   entry_nbytes, entry_tokens, is_trimmable, prefix_views)
from kvplugin.cache.store.lent import MAX_LENT, Lent
from kvplugin.cache.store.order import HOST_ORDER, next_victim
from kvplugin.cache.store.stats import StoreStats
from kvplugin.types import ColdTier, StoreEntry

__all__ = ["ColdTier", "MAX_LENT", "PromptStore", "StoreEntry", "StoreStats"]

log = logging.getLogger("kvplugin.cache")


class PromptStore(Demotion):
    """Tiered prompt store; see the module docstring for the exact semantics.

    ``max_bytes``: hot-tier budget in bytes (priced per entry at insert).
    ``max_entries``: optional hot-tier entry cap (0: nothing is kept hot).
    ``cold``: optional :class:`ColdTier` receiving evicted/oversized entries.
    ``on_evict``: observer called with each evicted :class:`StoreEntry` (outside
    the lock, before the spill; exceptions are logged and ignored).
    ``after_evictions``: called once after a batch of evictions has been disposed of (the
    session hands the freed memory back to the system there).
    ``on_spill``: observer called with ``(tokens, cache)`` of each entry the cold tier
    accepted (evicted, oversized or flushed; outside the lock; exceptions logged, ignored).
    ``demote``/``on_demote``: the pressure policy's codec and observer (:mod:`.demotion`).
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        max_entries: int | None = None,
        cold: ColdTier | None = None,
        on_evict: Callable[[StoreEntry], None] | None = None,
        after_evictions: Callable[[], None] | None = None,
        on_spill: Callable[[Sequence[int], list], None] | None = None,
        demote: Demote | None = None,
        on_demote: OnDemote | None = None,
    ):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if max_entries is not None and max_entries < 0:
            raise ValueError("max_entries must be >= 0 or None")
        self.max_bytes = int(max_bytes)
        self.max_entries = max_entries
        self.cold = cold
        self.on_evict = on_evict
        self.after_evictions = after_evictions
        self.on_spill = on_spill
        self._lock = threading.RLock()
        self._index = KeyIndex(size=lambda e: e.nbytes)  # (model_key, tokens) -> StoreEntry
        self._owner: dict[int, StoreEntry] = {}  # id(first layer) -> entry holding it
        self._lent = Lent()  # snapshots of entries moved out
        self._kinds = False  # entries of kinds the host evicts in its own order (order.py)
        self._moving: dict[int, tuple[StoreEntry, int]] = {}  # thread -> its fetch's move
        self._c = dict.fromkeys(("stored hits misses evictions spills cold_hits discarded moved "
                                 "copied tokens_reused rejected replaced superseded lent_copies "
                                 "lent_kept").split(), 0)
        self._init_demotion(demote, on_demote)

    # ---------------------------------------------------------------- basics
    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes held by the hot tier (sum of the entries' prices)."""
        with self._lock:
            return self._index.nbytes

    def entries(self) -> list[StoreEntry]:
        """The hot-tier entries, least recently used first (a snapshot list)."""
        with self._lock:
            return self._index.values()

    def snapshot(self) -> tuple[StoreStats, list[StoreEntry]]:
        """Counters and entries taken under one lock, so they agree with each other."""
        with self._lock:
            return self.stats(), self.entries()

    def stats(self) -> StoreStats:
        """Snapshot of the counters (see :class:`StoreStats`)."""
        with self._lock:
            by_kind: dict[str, int] = {}
            for e in self._index.values():
                for layer in e.cache:
                    name = type(layer).__name__
                    by_kind[name] = by_kind.get(name, 0) + entry_nbytes([layer])
            s = StoreStats(entries=len(self._index), bytes=self._index.nbytes,
                           bytes_by_kind=by_kind, **self._c)
        cold = self.cold
        if cold is not None:
            try:
                s.cold_entries = len(cold)  # type: ignore[arg-type]
                s.cold_bytes = int(cold.nbytes)  # type: ignore[attr-defined]
            except Exception:
                pass
        return s

    def close(self) -> None:
        """Close the cold tier (hot entries are simply dropped with the store)."""
        self._stop_demotion()
        if self.cold is not None:
            self.cold.close()

    # ---------------------------------------------------------------- internals

    def _remove(self, entry: StoreEntry) -> None:
        self._index.remove(entry.model_key, entry.tokens)
        if self._owner.get(id(entry.cache[0])) is entry:
            del self._owner[id(entry.cache[0])]

    def _evict_until(self, n_bytes: int, n_entries: int, keep=None) -> list:
        out = []
        index = self._index
        while len(index) and (index.nbytes > n_bytes or len(index) > n_entries):
            entry = next_victim(index.values(), keep) if self._kinds else index.oldest()
            if entry is keep or entry is None:  # with kinds: the host's own order
                break
            self._remove(entry)
            out.append(entry)
        self._c["evictions"] += len(out)
        return out

    def _dispose(self, evicted: list, *, spill: bool = True) -> None:
        """Outside the lock: observer hook, then spill or discard; then ``after_evictions``
        (once, when every evicted entry has been let go)."""
        released = False
        evicted.reverse()
        while evicted:
            entry = evicted.pop()  # release each entry as soon as it is handled
            if self.on_evict is not None:
                try:
                    self.on_evict(entry)
                except Exception:
                    log.exception("kvplugin: on_evict hook failed")
            ok = spill and self.cold is not None and self._cold_put(
                entry.model_key, entry.tokens,
                self._spill_form(entry.model_key, entry.tokens, entry.cache, entry.demotable))
            with self._lock:
                self._c["spills" if ok else "discarded"] += 1
            released = True
        entry = None
        if released and self.after_evictions is not None:
            try:
                self.after_evictions()
            except Exception:
                log.exception("kvplugin: after_evictions hook failed")

    def _cold_put(self, model_key, key, cache) -> bool:
        try:
            ok = bool(self.cold.put(model_key, key, cache))
        except Exception:
            log.exception("kvplugin: cold tier put failed")
            return False
        if ok and self.on_spill is not None:
            try:
                self.on_spill(key, cache)
            except Exception:
                log.exception("kvplugin: on_spill hook failed")
        return ok

    def _plan(self, model_key, key):
        return self._index.choose(
            model_key,
            key,
            trimmable=lambda e: is_trimmable(e.cache),
            copyable=lambda e, n: can_copy_prefix(e.cache, n),
        )

    def _execute(self, plan):
        """Under the lock: serve a hot plan.  Returns (cache, n) or None."""
        mode, entry, n = plan
        if mode == "move":
            self._remove(entry)
            extra = len(entry.tokens) - n
            if extra:
                for layer in entry.cache:
                    layer.trim(extra)
            self._c["moved"] += 1
            self._count_hit_precision(entry)
            self._moving[threading.get_ident()] = (entry, n)  # lent once dequantized (fetch)
            return entry.cache, n
        cache = copy_prefix(entry.cache, n, share=True)  # views: the donor stays stored
        if cache is None:
            return None
        # The donor's recency is left alone: the caller stores its own entry (holding the
        # same prefix) afterwards, and refreshing donors that share only a chat template's
        # first tokens would keep old conversations alive forever.
        self._c["copied"] += 1
        self._count_hit_precision(entry)
        return cache, n

    def _serve(self, plan, model_key, key) -> tuple[list | None, int]:
        """Under the lock: the hot plan, or a lent copy when that holds more; counted."""
        lent = self._lent.best(model_key, key) if self._lent else None
        if lent is not None and lent[1] > (plan[2] if plan else 0):
            snap, n, whole = lent
            cache = copy_lent(snap.cache, n, whole=whole)
            if cache is not None:
                self._c["lent_copies"] += 1
                self._hit(n)
                return cache, n
        return self._serve_hot(plan)

    def _hit(self, n: int) -> None:
        self._c["hits"] += 1
        self._c["tokens_reused"] += n

    def _serve_hot(self, plan) -> tuple[list | None, int]:
        """Under the lock: serve ``plan`` (or miss) and count it."""
        got = self._execute(plan) if plan else None
        if got is None:
            self._c["misses"] += 1
            return None, 0
        self._hit(got[1])
        return got

    # ---------------------------------------------------------------- API

    def insert(
        self, model_key: str, tokens: Sequence[int], cache: list, *, nbytes: int | None = None,
        prompt_len: int | None = None, demoted: bool = False, cold_only: bool = False,
        kind: str | None = None,
    ) -> bool:
        """Store ``cache`` (ownership passes to the store) under ``tokens`` (``demoted``: it
        was quantized by :meth:`demote_at_insert`).

        Returns True if the entry is now kept (hot tier, or cold tier for an
        oversized entry or with ``cold_only``), False if it was rejected.  May evict
        (and spill) LRU entries; that work happens before returning, in this thread.
        """
        key = to_key(tokens)
        if not key or not cache:
            with self._lock:
                self._c["rejected"] += 1
            return False
        price = entry_nbytes(cache) if nbytes is None else int(nbytes)
        entry = StoreEntry(model_key, key, cache, price, prompt_len, kind=kind)
        held = old = prev = None
        with self._lock:
            self._kinds = self._kinds or kind not in (None, HOST_ORDER[0])
            hot = price <= self.max_bytes and self.max_entries != 0 and not (
                cold_only and self.cold is not None)
            held = self._owner.get(id(cache[0]))
            if held is not None and (held.model_key, held.tokens) != (model_key, key):
                self._remove(held)  # same cache object re-inserted under a new key
            if hot:
                old = self._index.add(model_key, key, entry)
                if old is not None:
                    if self._owner.get(id(old.cache[0])) is old:
                        del self._owner[id(old.cache[0])]
                    if old.cache[0] is not cache[0]:
                        self._c["replaced"] += 1
                self._owner[id(cache[0])] = entry
                self._c["stored"] += 1
                self._new_entry_precision(entry, demoted=demoted)
                self.settle_lent(model_key, key, cache)
                if is_trimmable(cache) or can_copy_prefix(cache, len(key)):  # a quantized ring
                    for _, prev in self._index.prefixes_of(model_key, key):
                        if not _serves_all_of(cache, prev.cache):
                            continue
                        if prev.cache[0] is not cache[0]:
                            self._c["superseded"] += 1
                        self._remove(prev)
                    for common, prev in self._index.branches(model_key, key):
                        if (prev.prompt_len is not None and common >= prev.prompt_len
                                and _serves_all_of(cache, prev.cache)):
                            self._c["superseded"] += 1
                            self._remove(prev)
                evicted = self._make_room(self.max_bytes, self.max_entries, keep=entry)
        held = old = prev = None  # let go of every other entry before the memory is released
        if hot:
            self._dispose(evicted)
            return True
        ok = self.cold is not None and self._cold_put(
            model_key, key, self._spill_form(model_key, key, cache, self.demote is not None))
        with self._lock:
            self._c["spills" if ok else "rejected"] += 1
        return ok

    def publish(self, model_key: str, tokens: Sequence[int], cache: list) -> None:
        """Write ``cache`` through to the cold tiers that share entries as they are stored
        (a remote tier's optional ``publish``), so other processes can reuse it before it
        is ever evicted here. Call in the thread that owns ``cache``; never raises."""
        publish = getattr(self.cold, "publish", None)
        if publish is None:
            return
        try:
            publish(model_key, tokens, cache)
        except Exception:
            log.exception("kvplugin: cold tier publish failed")

    def fetch(self, model_key: str, tokens: Sequence[int], *,
              check: Callable[[list], bool] | None = None,
              dequantize: Callable[[list], list] | None = None) -> tuple[list | None, int]:
        """Longest-prefix lookup with move semantics; ``(cache, n)`` or ``(None, 0)``.

        The returned cache holds ``tokens[:n]`` and is owned by the caller;
        ``1 <= n < len(tokens)``.  See the module docstring. ``check``: asked of an entry
        from the cold tier (it crossed a disk or process boundary) before it is used; False:
        dropped, as if the tier had none. ``dequantize``: applied to the hit before it is
        handed out (a dequantization; what it raises reaches the caller, and a moved entry
        is then gone, as a miss).

        A moved entry is lent (see *Contention*) once dequantized. A dequantized one lends the
        quantized layers it was stored as (``dequantize`` gets a copy of the list, so they are
        not consumed): they stay beside the host's copy until the turn's first insert
        continues them, and that insert's codec copies their rows instead of quantizing the
        whole conversation again, dropping each layer once copied (:meth:`stored_prefix`).
        """
        me = threading.get_ident()
        self._moving.pop(me, None)
        cache, n = self._fetch(model_key, tokens, check)
        moved = self._moving.pop(me, None)
        if cache is None:
            return None, 0
        held, changed = cache, False
        if dequantize is not None:
            restored = dequantize(list(cache))
            changed = any(a is not b for a, b in zip(cache, restored))
            cache = restored if changed else cache
        if moved is not None:
            with self._lock:
                self._lent.lend(moved[0], moved[1], held if changed else cache)
        return cache, n

    def _fetch(self, model_key: str, tokens: Sequence[int],
               check: Callable[[list], bool] | None) -> tuple[list | None, int]:
        key = to_key(tokens)
        cold = self.cold
        with self._lock:
            plan = self._plan(model_key, key)
            hot_n = plan[2] if plan else 0
            want_cold = False
            if cold is not None and len(key) >= 2:
                probe = getattr(cold, "probe", None)
                try:
                    found = probe(model_key, key) if probe is not None else None
                    if found is None:  # no probe (or a wrapper of a tier without one)
                        # A tier that cannot tell without I/O (a remote one) says how many
                        # uncovered tokens make a lookup worth its round trips.
                        beyond = getattr(cold, "ask_beyond", None)
                        want_cold = plan is None or (
                            beyond is not None and len(key) - hot_n >= int(beyond))
                    else:
                        want_cold = min(int(found), len(key) - 1) > hot_n
                except Exception:
                    log.exception("kvplugin: cold tier probe failed")
            if not want_cold:
                return self._serve(plan, model_key, key)
        got = self._fetch_cold(model_key, key, hot_n)
        if got is not None and check is not None and not check(got[0]):
            discard = getattr(cold, "discard", None)  # kept by the tier (a prefix copy)
            if discard is not None:
                try:
                    discard(got[0])
                except Exception:
                    log.exception("kvplugin: cold tier discard failed")
            got = None
        with self._lock:
            if got is not None:
                self._hit(got[1])
                self._c["cold_hits"] += 1
                if entry_tokens(got[0]) in (None, got[1]):
                    # A whole entry the tier handed over (a consumed file): lent like a moved
                    # hot one, so a prefix its continuation cannot give is stored again.
                    lent = StoreEntry(model_key, key[:got[1]], got[0], 0)
                    self._moving[threading.get_ident()] = (lent, got[1])
                return got
            return self._serve(self._plan(model_key, key), model_key, key)

    def stored_prefix(self, model_key: str, tokens: Sequence[int]) -> list | None:
        """The entry held here that shares most leading tokens with ``tokens`` (stored, or
        moved out by this thread and lent as the codec stored it), as views cut to what it
        shares: what :meth:`~kvplugin.cache.service.service.KVService.prepare_entry` hands the
        codec, which copies the rows it already quantized instead of quantizing them again.
        A shared prefix counts, not only a whole stored key: a conversation's next turn
        usually reuses its previous entry only up to where the reply was tokenized anew.
        A new list: the codec drops each layer from it once used, so a lent entry (held by
        nothing else once settled) goes layer by layer as the new one is made."""
        key = to_key(tokens)
        with self._lock:
            found = [*self._index.prefixes_of(model_key, key),
                     *self._index.branches(model_key, key), *self._lent.shared(model_key, key)]
        if not found:
            return None
        n, entry = max(found, key=lambda f: f[0])
        if n < 1:
            return None
        return list(entry.cache) if n == len(entry.tokens) else prefix_views(entry.cache, n)

    def settle_lent(self, model_key: str, tokens: Sequence[int], cache: list) -> None:
        """Settle the lent snapshots that an entry of ``tokens`` holding ``cache`` continues
        (see *Contention*). :meth:`insert` does; a caller about to trim or quantize ``cache``
        does it first: a snapshot holds the host's live layers themselves, which would then
        stay whole until the new entry is made, beside it."""
        key = to_key(tokens)
        with self._lock:
            for lent in self._lent.settle(model_key, key, cache):
                kept = copy_lent(lent.cache, len(lent.tokens), whole=True)
                if kept is not None and self._index.get(model_key, lent.tokens) is None:
                    again = StoreEntry(model_key, lent.tokens, kept, entry_nbytes(kept),
                                       kind=lent.kind)
                    self._index.add(model_key, lent.tokens, again)
                    self._owner[id(kept[0])] = again
                    self._new_entry_precision(again, inserted=False)
                    self._c["lent_kept"] += 1

    def _fetch_cold(self, model_key, key, have: int = 0):
        """Outside the lock.  (cache, n) with 1 <= n < len(key), or None. ``have``: what
        the hot tier holds, for a tier with ``ask_beyond`` (it answers only with more)."""
        try:
            if getattr(self.cold, "ask_beyond", None) is not None:
                got = self.cold.fetch(model_key, key, have=have)
            else:
                got = self.cold.fetch(model_key, key)
        except Exception:
            log.exception("kvplugin: cold tier fetch failed")
            return None
        if not got:
            return None
        cache, n = got
        if not cache or not 1 <= n <= len(key):
            return None
        if n == len(key):
            if is_trimmable(cache):
                for layer in cache:
                    layer.trim(1)
                n -= 1
            else:  # nothing left to process: keep it hot, let the hot tier answer
                self.insert(model_key, key, cache)
                return None
        return (cache, n) if n >= 1 else None

    def trim_to(self, *, n_bytes: int | None = None, n_entries: int | None = None) -> None:
        """Evict LRU hot entries until ``nbytes <= n_bytes`` and ``len <= n_entries``
        (None: no limit on that axis).  Evicted entries go through ``on_evict`` and
        spill like any eviction."""
        with self._lock:
            evicted = self._make_room(max(0, n_bytes) if n_bytes is not None else 1 << 62,
                                      max(0, n_entries) if n_entries is not None else None)
        self._dispose(evicted)

    def flush(self) -> bool:
        """Spill every hot entry to the cold tier (shut-down). True if one was written."""
        if self.cold is None:
            return False
        before = self.stats().spills
        self.trim_to(n_bytes=0, n_entries=0)
        return self.stats().spills > before

    def drop_all(self) -> None:
        """Evict every hot entry without spilling it (a host's "clear the cache"): evicted
        entries still go through ``on_evict`` and count as discarded."""
        with self._lock:
            evicted = self._evict_until(0, 0)
            self._lent.clear()
        self._dispose(evicted, spill=False)

    def attach_cold(self, cold: ColdTier) -> None:
        """Give a store that has none a cold tier (persistence found after start-up)."""
        with self._lock:
            if self.cold is not None:
                raise ValueError("the store already has a cold tier")
            self.cold = cold


def _serves_all_of(cache: list, prev: list) -> bool:
    """Whether ``cache`` can give by a copy every prefix ``prev`` could: only then may it
    supersede ``prev`` (a chunked layer trimmed at its front cannot serve early cuts)."""
    floor = copy_floor(prev)
    return floor is None or can_copy_prefix(cache, floor)
