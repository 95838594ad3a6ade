"""The engine's front desk: what a host adapter calls at each cache event.

One :class:`KVService` per served process ties the resolved settings, the plugin hooks
and the tiered :class:`~kvplugin.cache.store.PromptStore` together, and keeps the
counters users see (``/kvplugin/stats``, Prometheus). Adapters translate host calls into
these methods; every policy decision (trim, quantize or not, bound, spill) is made here
or in a hook, never in an adapter.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvplugin.settings import KVPluginSettings


@dataclass
class Counters:
    """kvplugin's own counters (the store's hits/misses/evictions come from the store)."""

    entries_stored: int = 0
    entries_quantized: int = 0
    layers_not_quantized: int = 0
    bytes_before: int = 0  # what the host would have stored (live cache, with slack)
    bytes_stored: int = 0  # what kvplugin stored (trimmed, maybe quantized)
    caches_made: int = 0
    caches_bounded: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_stored


class KVService:
    """Settings + hooks + store for one host process."""

    def __init__(
        self,
        settings: KVPluginSettings,
        *,
        host: str,
        max_bytes: int | None = None,
        max_entries: int | None = None,
        pm: Any = None,
    ) -> None:
        from kvplugin.cache.store import PromptStore
        from kvplugin.plugins import get_plugin_manager

        self.settings = settings
        self.host = host
        self.pm = pm or get_plugin_manager()
        self.counters = Counters()
        self._lock = threading.Lock()
        self.pm.hook.kvplugin_configure.call_historic(
            kwargs={"settings": settings, "host": host}
        )
        cold = self.pm.hook.kvplugin_store_backend(settings=settings)
        self.store = PromptStore(
            max_bytes=max_bytes if max_bytes is not None else 1 << 62,
            max_entries=max_entries,
            cold=cold,
            on_evict=self._on_evict,
        )

    # -- cache construction -------------------------------------------------------
    def make_cache(self, model: Any, cache: list) -> list:
        """The host just built a fresh per-request cache: bound / re-step it."""
        shaped = self.pm.hook.kvplugin_make_cache(model=model, cache=cache, settings=self.settings)
        with self._lock:
            self.counters.caches_made += 1
            if shaped is not None and self.settings.max_kv_size is not None:
                self.counters.caches_bounded += 1
        return cache if shaped is None else shaped

    # -- storing ------------------------------------------------------------------------
    def prepare_entry(self, cache: list, num_tokens: int) -> list:
        """Trim and (per settings) quantize an entry before it is stored."""
        from kvplugin.cache.trim import entry_nbytes

        before = entry_nbytes(cache)
        trimmed = self.pm.hook.kvplugin_trim_entry(cache=cache)
        entry = cache if trimmed is None else trimmed
        quantized = None
        if self.settings.kv_cache_quantization:
            quantized = self.pm.hook.kvplugin_quantize_entry(
                cache=entry, num_tokens=num_tokens, settings=self.settings
            )
        if quantized is not None:
            entry = quantized
        after = entry_nbytes(entry)
        with self._lock:
            self.counters.entries_stored += 1
            self.counters.bytes_before += before
            self.counters.bytes_stored += after
            if quantized is not None:
                self.counters.entries_quantized += 1
        return entry

    def insert(self, model_key: str, tokens: Sequence[int], cache: list) -> bool:
        """Trim/quantize ``cache`` and store it under ``tokens`` (it is owned by us now)."""
        entry = self.prepare_entry(cache, len(tokens))
        return self.store.insert(model_key, list(tokens), entry)

    # -- fetching -------------------------------------------------------------------------
    def fetch(self, model_key: str, tokens: Sequence[int]) -> tuple[list | None, int]:
        """Move the best stored entry to the caller, restored to full precision.

        Returns ``(cache, n)``: the cache covers the first ``n`` tokens of ``tokens``
        (at least one token is always left to process), or ``(None, 0)`` on a miss.
        Plain layers get their growth room back one layer at a time
        (:func:`~kvplugin.cache.trim.with_headroom`), so the next token does not make
        every layer grow at once.
        """
        from kvplugin.cache.trim import with_headroom

        cache, n = self.store.fetch(model_key, list(tokens))
        if cache is None:
            return None, 0
        return with_headroom(self.restore(cache)), n

    def restore(self, cache: list) -> list:
        restored = self.pm.hook.kvplugin_dequantize_entry(cache=cache, settings=self.settings)
        return cache if restored is None else restored

    # -- reporting -----------------------------------------------------------------------
    def _on_evict(self, entry: Any) -> None:
        self.pm.hook.kvplugin_on_evict(entry=entry, settings=self.settings)

    def stats(self, store_stats: Any = None) -> dict[str, Any]:
        """All counters as one flat JSON-able dict (the store's and kvplugin's)."""
        with self._lock:
            out: dict[str, Any] = asdict(self.counters)
            out["bytes_saved"] = self.counters.bytes_saved
        store = asdict(store_stats if store_stats is not None else self.store.stats())
        out.update({f"store_{k}": v for k, v in store.items()})
        out["quantization"] = (
            {
                "bits": self.settings.kv_cache_quantization_bits,
                "group_size": self.settings.kv_cache_quantization_group_size,
                "min_tokens": self.settings.kv_cache_min_quantize_tokens,
            }
            if self.settings.kv_cache_quantization
            else None
        )
        out["host"] = self.host
        out["hot_cache_only"] = self.settings.hot_cache_only
        out["max_kv_size"] = self.settings.max_kv_size
        return out

    def report(self) -> dict[str, Any]:
        """:meth:`stats` plus every stored entry, from one consistent snapshot.

        This is what the host adapters serve at ``GET /kvplugin/stats``.
        """
        store_stats, entries = self.store.snapshot()
        out = self.stats(store_stats)
        out["max_bytes"] = self.store.max_bytes
        out["max_entries"] = self.store.max_entries
        described = []
        for e in entries:
            try:
                described.append(describe_entry(e.model_key, e.tokens, e.cache, e.nbytes))
            except Exception as exc:  # reporting must never fail a request
                described.append({"error": f"{type(exc).__name__}: {exc}"})
        out["entries"] = described
        return out


def _layer_bits(layer: Any) -> int | None:
    bits = getattr(layer, "bits", None)
    return bits if isinstance(bits, int) and not isinstance(bits, bool) else None


def _dense_nbytes(layer: Any) -> int:
    """Bytes the layer's used tokens take in full precision (its own bytes if not quantized)."""
    bits = _layer_bits(layer)
    keys = getattr(layer, "keys", None)
    if bits is None or not isinstance(keys, (tuple, list)) or not keys:
        try:
            return int(layer.nbytes)
        except Exception:
            return 0
    total = 0
    dtype_size = 2
    scales = keys[1] if len(keys) > 1 else None
    if scales is not None:
        dtype_size = scales.dtype.size
    n = int(getattr(layer, "offset", 0) or 0)
    for parts in (layer.keys, layer.values):
        packed = parts[0]
        *lead, _, packed_dim = packed.shape
        dim = packed_dim * 32 // bits
        count = n * dim
        for d in lead:
            count *= d
        total += count * dtype_size
    return total


def describe_entry(model_key: Any, tokens: Sequence[int], cache: list, nbytes: int) -> dict:
    """One stored entry as JSON-able data (``/kvplugin/stats`` of every host)."""
    return {
        "model": str(model_key),
        "tokens": len(tokens),
        "nbytes": int(nbytes),
        "dense_nbytes": sum(_dense_nbytes(layer) for layer in cache),
        "layers": [type(layer).__name__ for layer in cache],
        "bits": [_layer_bits(layer) for layer in cache],
        "offsets": sorted({int(getattr(layer, "offset", 0) or 0) for layer in cache}),
    }
