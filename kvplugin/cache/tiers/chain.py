"""Several cold tiers behind the hot one, nearest first (the SSD directory, then Redis).

Why a chain and not a store that knows each tier: the store speaks one
:class:`kvplugin.types.ColdTier`; the chain is one, so the store, the shut-down wrapper and
third-party backends stay as they are. Spills go to the first tier that takes them; a fetch
asks the tiers in order and the first hit wins (a nearer tier is faster than a longer prefix
is worth); ``publish`` (write-through at store time) reaches every tier that has it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["TierChain"]


class TierChain:
    """A :class:`kvplugin.types.ColdTier` over ``tiers`` (nearest first)."""

    def __init__(self, tiers: Sequence[Any]) -> None:
        self.tiers = list(tiers)
        self._served: OrderedDict[int, Any] = OrderedDict()  # id(cache) -> tier it came from

    def put(self, model_key: Any, tokens: Sequence[int], cache: list) -> bool:
        return any(tier.put(model_key, tokens, cache) for tier in self.tiers)

    def publish(self, model_key: Any, tokens: Sequence[int], cache: list) -> bool:
        sent = False
        for tier in self.tiers:
            publish = getattr(tier, "publish", None)
            if publish is not None:
                sent = bool(publish(model_key, tokens, cache)) or sent
        return sent

    @property
    def ask_beyond(self) -> int | None:
        """The smallest ``ask_beyond`` of the tiers (see :mod:`kvplugin.cache.store.prompt_store`)."""
        found = [t.ask_beyond for t in self.tiers if getattr(t, "ask_beyond", None) is not None]
        return min(found) if found else None

    def fetch(self, model_key: Any, tokens: Sequence[int], *,
              have: int = 0) -> tuple[list, int] | None:
        for tier in self.tiers:
            if getattr(tier, "ask_beyond", None) is not None:
                got = tier.fetch(model_key, tokens, have=have)
            else:
                got = tier.fetch(model_key, tokens)
            if got is not None:
                self._served[id(got[0])] = tier
                while len(self._served) > 16:
                    self._served.popitem(last=False)
                return got
        return None

    def probe(self, model_key: Any, tokens: Sequence[int]) -> int | None:
        """The first tier's promise where it makes one and it is positive; else None (the
        store then asks the chain on a hot miss, which reaches the tiers without a probe)."""
        for tier in self.tiers:
            probe = getattr(tier, "probe", None)
            found = probe(model_key, tokens) if probe is not None else None
            if found:
                return found
        return None

    def discard(self, cache: list) -> None:
        tier = self._served.pop(id(cache), None)
        discard = getattr(tier, "discard", None)
        if discard is not None:
            discard(cache)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def __len__(self) -> int:
        return sum(len(t) for t in self.tiers if hasattr(t, "__len__"))

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tiers if hasattr(t, "nbytes"))

    def stats(self) -> dict:
        out: dict = {}
        for tier in self.tiers:
            stats = getattr(tier, "stats", None)
            if callable(stats):
                out.update(stats())
        return out
