"""The types kvplugin's hooks speak: what a plugin receives and what it may return.

Why a module of its own: the hook contract (``kvplugin.hookspecs``) and every plugin must be
able to name these types without importing the engine (which imports mlx) or the plugin
manager. This module imports nothing of kvplugin and nothing beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["CacheEntry", "ColdTier", "StoreEntry"]

#: A cache entry: the list of per-layer cache objects mlx-lm's ``make_prompt_cache``
#: returns (``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache``, ...).
CacheEntry = list


@dataclass
class StoreEntry:
    """One hot-tier entry; what ``kvplugin_on_evict`` receives."""

    model_key: Hashable
    tokens: tuple  # tuple[int, ...]
    cache: list
    nbytes: int
    #: How many leading tokens were the request's prompt (the rest was generated), when the
    #: session could tell; lets a later turn of the same conversation supersede this entry.
    prompt_len: int | None = None
    #: The pressure policy may still quantize it in place (full precision, not yet tried).
    demotable: bool = False
    #: Quantized in place by the pressure policy (a hit on it is restored, not moved as is).
    demoted: bool = False
    #: The host's kind of entry (mlx-lm's ``cache_type``), for its eviction order
    #: (:mod:`kvplugin.cache.store.order`); None: the host gives none.
    kind: str | None = None


@runtime_checkable
class ColdTier(Protocol):
    """What a cold-storage plugin implements (``kvplugin_store_backend``). Thread-safe.

    ``put(model_key, tokens, cache) -> bool``: keep a copy of ``cache`` (the store drops its
    reference after the call); False if refused. Must not keep references to the arrays past
    the call unless it owns them.

    ``fetch(model_key, tokens) -> (cache, n) | None``: a cache holding exactly ``tokens[:n]``,
    ``1 <= n <= len(tokens)``, that no one else references (the caller will write into it).
    Normally the longest stored prefix of ``tokens``. Whether the stored copy is consumed is
    the tier's choice (the SSD tier: a prefix hit consumes the file, a common-prefix copy
    keeps it).

    ``close()``: release resources; further calls may fail. The store calls it once, at
    shut-down, after flushing what should persist.

    Optional ``probe(model_key, tokens) -> int``: without I/O, the ``n`` that ``fetch`` would
    return now (0 if none); lets the store prefer a better cold entry over a weaker hot one.
    Optional ``__len__`` and ``nbytes``: reported in the stats.

    Optional ``publish(model_key, tokens, cache)``: called in the storing thread right after
    an entry is stored in the hot tier (write-through, for a tier that shares entries with
    other processes, e.g. Redis); must not keep ``cache``'s arrays past the call. Optional
    ``ask_beyond`` (int): a tier whose lookups cost I/O and so has no ``probe`` is also asked
    when a hot hit leaves at least that many tokens uncovered; its ``fetch`` then takes
    ``have=`` (the hot hit's length) and answers only with more.
    """

    def put(self, model_key: str, tokens: Sequence[int], cache: list) -> bool: ...

    def fetch(self, model_key: str, tokens: Sequence[int]) -> tuple[list, int] | None: ...

    def close(self) -> None: ...
