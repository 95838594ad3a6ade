"""A cold tier written only when the host persists (shut-down), read at any time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ShutdownOnlyTier"]


class ShutdownOnlyTier:
    """A cold tier written only when the host persists (shut-down), read at any time.

    Why: a host that saves its prompt cache at shut-down and loads it at start-up (vllm-mlx)
    expects evictions while serving to be discarded, as its own cache does; only the
    shut-down save writes.
    """

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.accept_puts = False

    def put(self, model_key: Any, tokens: Sequence[int], cache: list) -> bool:
        return self.accept_puts and bool(self.tier.put(model_key, tokens, cache))

    def fetch(self, model_key: Any, tokens: Sequence[int]) -> Any:
        return self.tier.fetch(model_key, tokens)

    def discard(self, cache: list) -> None:
        discard = getattr(self.tier, "discard", None)
        if discard is not None:
            discard(cache)

    def probe(self, model_key: Any, tokens: Sequence[int]) -> int | None:
        probe = getattr(self.tier, "probe", None)
        return probe(model_key, tokens) if probe is not None else None

    def close(self) -> None:
        self.tier.close()

    def __len__(self) -> int:
        return len(self.tier)

    @property
    def nbytes(self) -> int:
        return int(self.tier.nbytes)
