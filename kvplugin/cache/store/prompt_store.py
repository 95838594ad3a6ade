"""Tiered prompt store: a RAM hot tier with move-on-fetch, and a pluggable cold tier.

Host-independent and tier-independent: the cold tier is any :class:`kvplugin.types.ColdTier`
handed in (the built-in one, ``kvplugin.cache.tiers.ssd.SSDTier``, is never imported here).
What a layer can do (trim, copy a prefix, price) is asked of :mod:`kvplugin.cache.layers`;
the token index (trie + LRU) is :class:`kvplugin.cache.store.index.KeyIndex`.

Vocabulary
----------
* A **cache entry** is a list of per-layer mlx-lm cache objects (``KVCache``,
  ``QuantizedKVCache``, ``RotatingKVCache``, ...), exactly what ``make_prompt_cache``
  returns.  Its **key** is ``(model_key, tuple(tokens))``.  The store assumes the
  entry holds exactly ``len(tokens)`` positions (layer ``offset == len(tokens)``), the
  same assumption mlx-lm's ``LRUPromptCache`` makes when it trims.
* **Trimmable** entry: every layer's ``is_trimmable()`` is true.  **Copyable** prefix:
  trimmable *and* every layer is of a kind whose first ``n`` positions can be copied
  (``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache`` while ``offset < max_size``,
  ``ChunkedKVCache`` if ``n >= start_position``, ``ConcatenateKVCache``, and
  ``CacheList`` of those; subclasses too, if their extra instance attributes are
  plain scalars).

Ownership
---------
``insert`` hands ownership of the cache to the store; the caller must not touch it
afterwards.  Nothing is copied at insert.  ``fetch`` hands ownership back.

Hot tier
--------
* Per ``model_key`` a radix (path-compressed) trie over token tuples: insert, remove
  and lookup cost O(len(tokens)); nothing scans all entries or bytes.
* One global LRU order over all model keys.  ``insert`` and a copy-hit (below) make
  an entry most-recently used.
* Entries are priced at insert by ``nbytes`` (default :func:`kvplugin.cache.layers.entry_nbytes` = sum of
  the layers' ``nbytes``, i.e. the real bytes held, spare capacity included).
  After an insert the store evicts LRU entries while ``nbytes > max_bytes`` or
  ``len > max_entries``; the entry just inserted is never evicted by its own insert.
* An entry with ``nbytes > max_bytes`` (or any entry when ``max_entries == 0``)
  never enters the hot tier: it goes straight to the cold tier (``insert`` returns
  the cold tier's verdict), or, without one, is rejected (``rejected`` counter,
  ``insert`` returns False).  Nothing is evicted for it.
* Inserting a key that is already stored replaces the old entry (``replaced``).
  Inserting a *trimmable* entry removes stored entries whose tokens are a strict
  prefix of it on the same model (``superseded``): the longer entry can serve them
  by a prefix copy (mlx-lm ``LRUPromptCache`` does the same). It also removes an entry
  whose whole *prompt* it continues (``prompt_len`` known, the rest of that entry was
  generated): that is the same conversation's previous turn, whose reply came back
  re-tokenized differently in the next prompt. No request can want that generated tail
  that the new entry cannot serve (a text API re-tokenizes it), so keeping both would hold
  the conversation twice.  Inserting a cache
  whose first layer object is already stored under another key moves it to the new
  key (one object is never held by two entries).  None of these is an eviction:
  no ``on_evict``, no spill.

Fetch (longest prefix, move semantics)
--------------------------------------
``fetch(model_key, tokens) -> (cache | None, n)``.  ``n`` is the number of leading
request tokens the returned cache holds; the caller processes ``tokens[n:]``.
Always ``1 <= n <= len(tokens) - 1`` on a hit (so a request of < 2 tokens always
misses): at least one token is left to feed the model, as mlx-lm's "longer entry"
path does with ``prefix = min(len(tokens) - 1, common)``.  (Stock
``fetch_nearest_cache`` returns an empty rest on an exact hit in 0.31.3/0.32.2,
which ``stream_generate`` rejects; we trim one token instead.)

1. *Prefix hit, moved.*  The longest stored key that is a prefix of the request:
   * strictly shorter than the request: the entry is **removed** from the store and
     its cache object (the very same list and arrays, no deepcopy) is returned,
     ``n = len(key)``;
   * equal to the request: only if trimmable; it is removed, trimmed by one token
     (``layer.trim(1)``), ``n = len(tokens) - 1``.  A non-trimmable exact entry is
     left stored and the next shorter prefix entry is considered instead.
2. *Common-prefix hit, copied.*  If a stored key diverges from (or extends) the
   request after ``c`` common tokens and ``min(c, len(tokens) - 1)`` beats the best
   move candidate, that entry **stays stored** for its owner and the caller gets
   fresh arrays holding just the first ``n = min(c, len(tokens) - 1)`` positions
   (``mx.array(x[..., :n, :])`` + ``mx.eval``; no buffer is shared with the stored
   entry).  Only for copyable entries, otherwise this candidate is ignored.  Among
   several entries below the divergence point the first one found on a descent of
   the trie is used.  Ties between a move and a copy go to the move.
3. *Lent copy.*  If an entry moved out to a request still in flight ("lent") holds more of
   the request than 1. and 2., the caller gets a copy of it (``lent_copies``), as stock's
   deep copy would give it: the first ``n`` positions when the lent entry can be cut there,
   or all of it when the request continues its whole key (recurrent state and wrapped
   windows cannot be cut). See *Contention* below.
4. Otherwise a miss ``(None, 0)``.

The caller gives the (updated) cache back with ``insert`` after generation.  Because
a fetch moves the entry out, a second concurrent fetch of the same prefix while the
first caller holds it gets a miss, or whatever shorter/other entry is still stored
(possibly a copy from another conversation's entry).  A returned buffer is never
referenced by a stored entry or by another caller, so the first in-place decode
write does not double memory (unlike ``copy.deepcopy``).

Contention
----------
A move records what it hands out, once ``fetch``'s ``restore`` (dequantization) has made it
(:mod:`kvplugin.cache.store.lent`, :func:`kvplugin.cache.layers.lend_view`): a dequantized
entry's quantized layers as they were stored (the turn's insert copies their rows), else
append-only layers (``KVCache``) themselves, whose prefix never changes and which cost nothing to keep;
other layers as a snapshot (new array objects on the same buffers, no bytes copied; the
owner's first in-place write into a shared buffer copies it, as stock's deep copy would
have up front: a window or a recurrent state, small). The snapshot is
copied from only when a concurrent request wants that prefix (fetch rule 3). When a later
insert continues the snapshot's key (its owner, or a conversation it served, giving back),
the snapshot is dropped if the new entry can serve its prefix by a copy or it was a
finished turn (``prompt_len`` known: superseded, as above); otherwise (a shared prefix such
as a system-prompt checkpoint whose continuation is recurrent state or a wrapped window,
which cannot be cut back) it is stored again under its key (``lent_kept``), as stock keeps
that entry. At most :data:`MAX_LENT` snapshots are held (the oldest is dropped).

Cold tier
---------
Every hot eviction (budget, ``max_entries``, ``trim_to``) is first reported to
``on_evict(entry)`` (with or without a cold tier).  ``cold=None`` is oMLX's
``hot_cache_only``: evicted entries are then dropped and counted in ``discarded``;
nothing is written anywhere, no directory is created.  With a cold tier:

* each evicted entry is then given to ``cold.put`` (``spills``; a refused or failed
  put counts in ``discarded``).  Callbacks and cold I/O run in the calling thread
  but **outside** the store lock, so other threads keep using the hot tier
  meanwhile; an entry being spilled is briefly in neither tier (a miss, never an
  error).
* ``fetch`` asks the cold tier when its ``probe`` (optional method) promises more
  tokens than the best hot candidate, or, for tiers without ``probe``, on a hot miss,
  and, for a tier with an ``ask_beyond`` attribute (a remote tier, whose lookups are
  I/O), also when the hot hit leaves at least that many tokens uncovered; such a tier's
  ``fetch`` takes ``have=`` (the hot hit's length) and answers only with more.  A cold hit is handed to the caller (``cold_hits``; for ``SSDTier`` a
  prefix hit consumes the file, i.e. it is promoted to the caller, who re-inserts it
  into the hot tier after generation).  If the cold tier returns a cache covering
  the whole request, it is trimmed by one token when trimmable; otherwise it is
  inserted into the hot tier and the fetch continues with the hot tier.
* Errors in the cold tier are logged and treated as misses / failed spills.

Thread safety
-------------
Every public method takes the store's single lock for all index/LRU/counter work.
Prefix copies are made under the lock (so a concurrent move cannot change the
source mid-copy).  Cold-tier I/O and ``on_evict`` run outside the lock (above).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvplugin.cache.store.index import KeyIndex, to_key
from kvplugin.cache.layers import (can_copy_prefix, copy_floor, copy_lent, copy_prefix,
                                   entry_nbytes, entry_tokens, is_trimmable, prefix_views)
from kvplugin.cache.store.lent import MAX_LENT, Lent
from kvplugin.types import ColdTier, StoreEntry

__all__ = ["ColdTier", "MAX_LENT", "PromptStore", "StoreEntry", "StoreStats"]

log = logging.getLogger("kvplugin.cache")


@dataclass
class StoreStats:
    """Counters of a :class:`PromptStore` (a snapshot).

    entries/bytes: hot tier now.  stored: inserts that entered the hot tier.
    hits/misses: fetches.  moved/copied/cold_hits: how hits were served (hits =
    moved + copied + cold_hits).  tokens_reused: sum of ``n`` over hits.
    evictions: LRU evictions from the hot tier (budget, max_entries, trim_to).
    spills: evicted or oversized entries accepted by the cold tier.  discarded:
    evicted entries not kept anywhere (no cold tier, or it refused).  rejected:
    inserts kept nowhere (empty, or oversized and no cold tier took it).
    replaced/superseded: see module docstring.  lent_copies: hits served from a copy of
    an entry lent to a request in flight; lent_kept: snapshots stored again because
    their continuation could not serve their prefix (see *Contention*).  bytes_by_kind: hot bytes per layer
    class name.  cold_entries/cold_bytes: from the cold tier if it exposes
    ``__len__``/``nbytes``; ``None`` when there is no cold tier (never a fake -1).
    """

    entries: int
    bytes: int
    stored: int
    hits: int
    misses: int
    evictions: int
    spills: int
    cold_hits: int
    discarded: int
    moved: int = 0
    copied: int = 0
    tokens_reused: int = 0
    rejected: int = 0
    replaced: int = 0
    superseded: int = 0
    lent_copies: int = 0
    lent_kept: int = 0
    bytes_by_kind: dict = field(default_factory=dict)
    cold_entries: int | None = None
    cold_bytes: int | None = None



class PromptStore:
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
        self._moving: dict[int, tuple[StoreEntry, int]] = {}  # thread -> its fetch's move
        self._c = dict.fromkeys(
            (
                "stored hits misses evictions spills cold_hits discarded moved copied "
                "tokens_reused rejected replaced superseded lent_copies lent_kept"
            ).split(),
            0,
        )

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
            entry = index.oldest()
            if entry is keep:
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
            ok = spill and self.cold is not None and self._cold_put(entry.model_key, entry.tokens, entry.cache)
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
            self._moving[threading.get_ident()] = (entry, n)  # lent once restored (fetch)
            return entry.cache, n
        cache = copy_prefix(entry.cache, n, share=True)  # views: the donor stays stored
        if cache is None:
            return None
        # The donor's recency is left alone: the caller stores its own entry (holding the
        # same prefix) afterwards, and refreshing donors that share only a chat template's
        # first tokens would keep old conversations alive forever.
        self._c["copied"] += 1
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
        prompt_len: int | None = None,
    ) -> bool:
        """Store ``cache`` (ownership passes to the store) under ``tokens``.

        Returns True if the entry is now kept (hot tier, or cold tier for an
        oversized entry), False if it was rejected.  May evict (and spill) LRU
        entries; that work happens before returning, in this thread.
        """
        key = to_key(tokens)
        if not key or not cache:
            with self._lock:
                self._c["rejected"] += 1
            return False
        price = entry_nbytes(cache) if nbytes is None else int(nbytes)
        entry = StoreEntry(model_key, key, cache, price, prompt_len)
        evicted: list = []
        held = old = prev = None
        with self._lock:
            hot = price <= self.max_bytes and self.max_entries != 0
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
                self.settle_lent(model_key, key, cache)
                if is_trimmable(cache):
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
                n_entries = self.max_entries if self.max_entries is not None else 1 << 62
                evicted = self._evict_until(self.max_bytes, n_entries, keep=entry)
        held = old = prev = None  # let go of every other entry before the memory is released
        self._dispose(evicted)
        if hot:
            return True
        ok = self.cold is not None and self._cold_put(model_key, key, cache)
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
              restore: Callable[[list], list] | None = None) -> tuple[list | None, int]:
        """Longest-prefix lookup with move semantics; ``(cache, n)`` or ``(None, 0)``.

        The returned cache holds ``tokens[:n]`` and is owned by the caller;
        ``1 <= n < len(tokens)``.  See the module docstring. ``check``: asked of an entry
        from the cold tier (it crossed a disk or process boundary) before it is used; False:
        dropped, as if the tier had none. ``restore``: applied to the hit before it is
        handed out (a dequantization; what it raises reaches the caller, and a moved entry
        is then gone, as a miss).

        A moved entry is lent (see *Contention*) once restored. A dequantized one lends the
        quantized layers it was stored as (``restore`` gets a copy of the list, so they are
        not consumed): they stay beside the host's copy until the turn's first insert
        continues them, 0.28x (4-bit) to 0.53x (8-bit) of the entry, and that insert's codec
        copies their rows instead of quantizing the whole conversation again, dropping each
        layer once copied (:meth:`stored_prefix`; measured on SmolLM2: two of a warm turn's
        three whole-entry codec passes gone, and a lower process peak, docs/benchmarks.md).
        """
        me = threading.get_ident()
        self._moving.pop(me, None)
        cache, n = self._fetch(model_key, tokens, check)
        moved = self._moving.pop(me, None)
        if cache is None:
            return None, 0
        held, changed = cache, False
        if restore is not None:
            restored = restore(list(cache))
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
                    again = StoreEntry(model_key, lent.tokens, kept, entry_nbytes(kept))
                    self._index.add(model_key, lent.tokens, again)
                    self._owner[id(kept[0])] = again
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
            evicted = self._evict_until(
                max(0, n_bytes) if n_bytes is not None else 1 << 62,
                max(0, n_entries) if n_entries is not None else 1 << 62,
            )
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
