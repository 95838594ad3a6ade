"""The prompt cache that replaces mlx-openai-server's ``LRUPromptCache``: the host's interface
over the model process's :class:`~kvplugin.cache.service.service.KVService`.

Why a class of the host's shape: ``MLXLMHandler`` builds ``LRUPromptCache(max_size=...,
max_bytes=..., cache_dir=...)`` and its two paths call ``fetch_nearest_cache`` /
``insert_cache`` / ``trim_to`` on it; each call becomes one call of the service. Stock keeps
nothing in memory and pickles every entry into ``cache_dir``; here every entry is trimmed,
maybe quantized, and kept as a checked safetensors file by the service's SSD tier (in
``cache_dir``, else a private temporary directory), consumed on a hit, except the one that
just ended, held in memory until the next request; under ``--hot-cache-only`` entries stay
in memory instead and are moved out on a hit.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from typing import Any

from kvplugin.cache.model.fingerprint import model_fingerprint
from kvplugin.hosts.mlx_openai_server.salt import UNKNOWN, fetch_salt, insert_salt, tag_cache
from kvplugin.log import say

__all__ = ["KVPluginOaiPromptCache", "where_entries_live"]

#: the host's path that runs without a batch; the batched path's entries are tagged "batch"
NONBATCH = "nonbatch"


def where_entries_live(cache_dir: Any, max_bytes: int | None,
                       flags: Mapping[str, Any] | None = None) -> tuple[Any, bool, Any]:
    """The settings of the store that replaces stock's, whether its entries are held in
    memory only between requests, and its private directory (or None).

    Why: stock pickles every entry into ``--prompt-cache-dir`` (else a temporary directory)
    and holds none in memory, so a store that held entries beside running requests would
    raise the process's peak above stock's. Here they are files too, checked safetensors in
    the same place, bounded by ``--max-bytes``, and the one conversation that just ended
    stays in memory until the next request (:mod:`kvplugin.cache.service.idle_hold`).
    ``--hot-cache-only`` keeps them all in memory instead (faster hits for the memory they
    take), bounded by the same flag.
    """
    from kvplugin.settings import resolve_settings

    given = dict(flags or {})
    if cache_dir:
        given["ssd_cache_dir"] = cache_dir
    settings = resolve_settings(given or None)
    if settings.hot_cache_only:
        return settings, False, None
    scratch = None
    if settings.ssd_cache_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="kvplugin-oai-prompt-cache-")
        given["ssd_cache_dir"] = scratch.name
    if max_bytes is not None:
        given["ssd_cache_max_gb"] = max_bytes / 1e9
    return resolve_settings(given), True, scratch


class KVPluginOaiPromptCache:
    """mlx-openai-server's ``LRUPromptCache`` interface over one :class:`KVService`.

    ``source`` tags are honoured as stock honours them: an entry made by one of the host's
    paths (``batch`` or ``nonbatch``) is served only to a fetch that allows that path, by
    keying each path's entries apart. ``cache_type`` is accepted and ignored: the store keeps
    one LRU order. An exact hit leaves one token to process (stock returns none, which both
    of the host's paths then back off by one).
    """

    #: the adapter that installed this class (set by it: the class never imports it back)
    adapter: Any = None

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63,
                 cache_dir: Any = None) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.cache_dir = cache_dir
        self.service, self._scratch = self.adapter.create_service(
            max_bytes=max_bytes, max_entries=max_size, cache_dir=cache_dir)
        self.model: Any = None  # the nn.Module the handler runs (bind)
        self._model_key: str | None = None

    def bind(self, model: Any, *, checked: bool = True) -> None:
        """The handler's model: entries are keyed by its fingerprint, and (``checked``) an
        entry from a tier is checked against it before it is handed over."""
        self.model = model if checked else None
        self._model_key = self.service.model_key(model_fingerprint(model))

    def _key(self, source: str, salt: str | None) -> str:
        """The store key of ``source``'s entries for a request with ``salt``."""
        key = self._model_key
        if key is None:
            raise RuntimeError("the prompt cache has no model bound")
        # the batched path's entries keep the model's own key (shared with mlx-lm replicas)
        if source != "batch":
            key = self.service.salted_key(key, f"source:{source}")
        return self.service.salted_key(key, salt)

    # -- what the host calls -------------------------------------------------------------
    def __len__(self) -> int:
        return self.service.entries_held

    @property
    def nbytes(self) -> int:
        return self.service.bytes_held

    def fetch_nearest_cache(self, tokens_ids: list[int], *,
                            allowed_sources: set[str] | None = None) -> tuple[Any, list[int]]:
        sources = sorted(allowed_sources) if allowed_sources is not None else ["batch", NONBATCH]
        salt = fetch_salt()
        if salt is UNKNOWN:  # never served from a namespace that may not be the request's
            say("a prompt-cache fetch could not be matched to its request; served without a "
                "cached prefix", key="oai:fetch-unknown-salt")
            return None, tokens_ids
        for source in sources:
            try:
                cache, n = self.service.fetch(self._key(source, salt), tokens_ids,
                                              model=self.model)
            except Exception as exc:  # a request must never fail because of the store
                say(f"prompt cache fetch failed ({type(exc).__name__}: {exc}); serving "
                    "without a cached prefix", key="oai:fetch-failed")
                return None, tokens_ids
            if cache is not None and n > 0:
                tag_cache(cache, salt)  # the single-request path inserts it on another thread
                return cache, list(tokens_ids[n:])
        return None, tokens_ids

    def insert_cache(self, tokens_ids: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant", source: str = NONBATCH) -> None:
        salt = insert_salt(prompt_cache)
        if salt is UNKNOWN:  # never stored where another request's salt could find it
            say("a finished cache could not be matched to its request; not stored",
                key="oai:insert-unknown-salt")
            return
        try:
            self.service.give_back(self._key(source, salt), list(tokens_ids), prompt_cache)
        except Exception as exc:
            say(f"prompt cache insert failed ({type(exc).__name__}: {exc}); entry dropped",
                key="oai:insert-failed")

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        # the batched path asks for its budget minus the live batch, which may be below zero
        self.service.trim_to(n_bytes=None if n_bytes is None else max(0, n_bytes),
                             n_entries=None if n_sequences is None else max(0, n_sequences))

    def close(self) -> None:
        """Shut-down (the handler's cleanup): the store is closed; its SSD tier is kept in
        ``--prompt-cache-dir``, with the entries held in memory written out (a restart on
        the directory serves them), and a private directory is removed, as stock does."""
        try:
            if self._scratch is None:
                self.service.flush_configured()
        finally:
            self.service.close()
            if self._scratch is not None:
                self._scratch.cleanup()

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return {"kvplugin": {"n_sequences": len(self), "n_bytes": self.nbytes}}

    def log_cache_stats(self) -> None:
        """Stock logs its size after every request; kvplugin's numbers are on /kvplugin/stats."""

    # -- kvplugin ----------------------------------------------------------------------
    def report(self) -> dict:
        """The service's report plus the host version (``GET /kvplugin/stats``)."""
        return self.adapter.report(self.service)
