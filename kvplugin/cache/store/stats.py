"""The prompt store's counters, as one snapshot (``/kvplugin/stats`` reports them flat)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StoreStats"]


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
    replaced/superseded: see ``docs/store.md``.  lent_copies: hits served from a copy of
    an entry lent to a request in flight; lent_kept: snapshots stored again because
    their continuation could not serve their prefix (``docs/store.md``, *Contention*).
    demotions (by the worker, ahead of need), demotions_at_insert (entries the budget could not
    hold at full precision, quantized as they were stored), evictions_full (evicted at full precision: the
    worker had not reached them), bytes_saved_by_demotion, hits_full/hits_demoted (hot hits on full-precision / demoted entries): the pressure policy, ``docs/store.md``.
    bytes_by_kind: hot bytes per layer class name.  cold_entries/cold_bytes: from the cold tier if it exposes
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
    demotions: int = 0
    demotions_at_insert: int = 0
    evictions_full: int = 0
    bytes_saved_by_demotion: int = 0
    hits_full: int = 0
    hits_demoted: int = 0
    bytes_by_kind: dict = field(default_factory=dict)
    cold_entries: int | None = None
    cold_bytes: int | None = None
