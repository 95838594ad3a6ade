"""The prompt cache that replaces ``mlx_lm.server.LRUPromptCache``: the host's interface over
the process's :class:`~kvplugin.cache.service.service.KVService`.

Why a class of the host's shape: mlx-lm's ``run`` instantiates ``LRUPromptCache`` by name and
its generation loop calls ``fetch_nearest_cache`` / ``insert_cache`` / ``trim_to`` on it, so
the replacement answers those calls and translates each into one call of the service.
"""

from __future__ import annotations

from typing import Any

from kvplugin.cache.model.fingerprint import model_fingerprint
from kvplugin.hosts.mlx_lm.salt import UNKNOWN, fetch_salt, insert_salt
from kvplugin.log import say

__all__ = ["KVPluginPromptCache"]

#: mlx-lm's default ``max_bytes`` (no ``--prompt-cache-bytes``) and anything that large: none
_NO_BUDGET = 1 << 62


class KVPluginPromptCache:
    """mlx-lm's ``LRUPromptCache`` interface over one :class:`KVService`.

    Differences from stock, all deliberate: entries are trimmed to their
    used tokens and maybe quantized before storage; a fetch *moves* the entry to the
    caller (no deepcopy) and returns it dequantized; an exact hit leaves one token to
    process (stock returns no tokens, which both host paths reject); the byte budget
    (``max_bytes``, the host's ``--prompt-cache-bytes``) holds after every insert on
    both paths; evictions spill to the cold tier when there is one. ``cache_type`` orders
    evictions as stock's ``CacheOrder`` does (:mod:`kvplugin.cache.store.order`).
    """

    #: the adapter that installed this class (set by it: the class never imports it back)
    adapter: Any = None

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, service: Any = None):
        self.max_size = max_size
        self.max_bytes = max_bytes
        if service is None:
            service = self.adapter.take_pending_service()
        if service is None:  # built outside the wrapped ``run`` (a script): own service
            service = self.adapter.create_service(
                max_bytes=None if max_bytes >= _NO_BUDGET else max_bytes, max_entries=max_size
            )
        self.service = service

    # -- what mlx_lm.server calls -----------------------------------------------------
    def __len__(self) -> int:
        return self.service.entries_held

    @property
    def nbytes(self) -> int:
        return self.service.bytes_held

    def _key(self, model: Any, salt: Any) -> str:
        """The store key of a request with ``salt`` (its ``cache_salt``) on ``model``."""
        return self.service.salted_key(self.service.model_key(model_fingerprint(model)), salt)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        salt = fetch_salt()
        if salt is UNKNOWN:  # never served from a namespace that may not be the request's
            say("a prompt-cache fetch could not be matched to its request; served without a "
                "cached prefix", key="mlx-lm:fetch-unknown-salt")
            return None, tokens
        try:
            cache, n = self.service.fetch(self._key(model, salt), tokens,
                                          model=self.adapter.loaded_model(model))
        except Exception as exc:  # a request must never fail because of the store
            say(f"prompt cache fetch failed ({type(exc).__name__}: {exc}); serving "
                "without a cached prefix", key="mlx-lm:fetch-failed")
            return None, tokens
        if cache is None or n <= 0:
            return None, tokens
        return cache, tokens[n:]

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        salt = insert_salt(prompt_cache)
        if salt is UNKNOWN:  # never stored where another request's salt could find it
            say("a finished cache could not be matched to its request; not stored",
                key="mlx-lm:insert-unknown-salt")
            return
        try:
            self.service.give_back(self._key(model, salt), list(tokens), prompt_cache,
                                   kind=cache_type)
        except Exception as exc:
            say(f"prompt cache insert failed ({type(exc).__name__}: {exc}); entry "
                "dropped", key="mlx-lm:insert-failed")

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        self.service.trim_to(n_bytes=n_bytes, n_entries=n_sequences)

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return {"kvplugin": {"n_sequences": len(self), "n_bytes": self.nbytes}}

    # -- kvplugin ----------------------------------------------------------------------
    def report(self) -> dict:
        """The service's report plus the host version (``GET /kvplugin/stats``)."""
        return self.adapter.report(self.service)
