"""Which stored entry goes first: the host's own eviction order where it has one.

Why: mlx-lm's ``LRUPromptCache`` tags each entry with the part of the conversation it ends
(``cache_type``: a system-prompt checkpoint, a user prompt, a finished assistant turn) and
evicts from a kind while it holds at least as many entries as the next one, so assistant
turns go first and the shared system prompt last (``CacheOrder.pop``). With one plain LRU, a
store at the host's entry cap evicted the system-prompt checkpoint a later conversation
reused on stock (docs/benchmarks.md, "A shared system prompt inside a window"). Entries of
hosts that give no kind are all of the first kind: plain LRU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["HOST_ORDER", "next_victim"]

#: mlx-lm's ``LRUPromptCache.CacheOrder`` ordering (0.31.3-0.32.2), first evicted first
HOST_ORDER = ("assistant", "user", "system")


def next_victim(oldest_first: Iterable[Any], keep: Any = None) -> Any:
    """The entry to evict next (``.kind``; None or unknown: the first kind), of entries least
    recently used first, never ``keep`` (the entry an insert stores); None if there is none."""
    kinds: dict[str, list] = {k: [] for k in HOST_ORDER}
    for entry in oldest_first:
        if entry is not keep:
            kinds.get(entry.kind, kinds[HOST_ORDER[0]]).append(entry)
    for kind, after in zip(HOST_ORDER, HOST_ORDER[1:]):
        if kinds[kind] and len(kinds[kind]) >= len(kinds[after]):
            return kinds[kind][0]
    return next((kinds[k][0] for k in reversed(HOST_ORDER) if kinds[k]), None)
