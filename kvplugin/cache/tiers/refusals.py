"""Entries a tier did not take, counted by reason, each reason said once.

Why: a counter alone (``refused``) left a user with ``--max-kv-size`` and a cold tier
wondering why nothing reached the disk. Every refusal has a reason key (``unsupported:<layer
class>``, ``over_budget``, ...) counted in the tier's stats (``refused_by_reason``); a reason
that will repeat for every such entry (a layer kind the format cannot hold, an entry larger
than the budget) is also said in one ``kvplugin:`` line naming what and why.
"""

from __future__ import annotations

import threading

from kvplugin.cache.tiers.serialize import Unsupported

__all__ = ["Refusals"]


class Refusals:
    """Refusal counts of one tier (``where``: how its lines name it, e.g. ``cold tier DIR``)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._by_reason: dict[str, int] = {}

    def count(self, reason: str, say: str | None = None) -> None:
        """One more entry refused for ``reason``; ``say``: the line said the first time."""
        with self._lock:
            self._by_reason[reason] = self._by_reason.get(reason, 0) + 1
        if say is not None:
            from kvplugin.log import say as say_once

            say_once(f"{self.where} {say} (counted in refused_by_reason[{reason!r}])",
                     key=f"refused:{self.where}:{reason}")

    def unsupported(self, e: Unsupported, what: str) -> None:
        """An entry holding a layer the format cannot represent; ``what``: what is not done
        with such entries (``stores``, ``shares``)."""
        self.count(f"unsupported:{e.kind}",
                   f"{what} no entry holding {e.kind} layers: {e.why}; such entries stay "
                   "in memory only")

    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_reason)
