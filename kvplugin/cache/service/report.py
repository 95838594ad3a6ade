"""What the front desk reports: the flat stats (``/kvplugin/stats``, ``/metrics``), the
stored entries, and the one start-up line every host says.

Why apart from the front desk: reporting reads every part of the engine and decides nothing;
kept here, :class:`~kvplugin.cache.service.service.KVService` holds only policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvplugin.cache.layers import dense_nbytes, layer_bits
from kvplugin.cache.memory.release import mlx_memory
from kvplugin.cache.tiers import remote_stats
from kvplugin.codecs import codec_plan
from kvplugin.resources import masked_url

__all__ = ["COLD_FIELDS", "Reporting", "describe_entry"]

_UNLIMITED = 1 << 62
#: the cold tier's counters reported flat as ``cold_<name>`` (the SSD tier keeps them all)
#: the pressure policy's store counters, reported under their own names
DEMOTION_FIELDS = ("demotions", "demotions_at_insert", "evictions_full",
                   "bytes_saved_by_demotion", "hits_full", "hits_demoted")
COLD_FIELDS = ("corrupt", "unreadable", "refused", "puts", "evictions", "write_failures",
               "leftovers_removed", "symlinks", "disk_bytes")


class Reporting:
    """The service's reports (a mixin: it reads the service's counters, store, admission and
    settings under its ``_lock``)."""

    def stats(self, store_stats: Any = None) -> dict[str, Any]:
        """All counters as one flat JSON-able dict (the store's and kvplugin's)."""
        with self._lock:
            out: dict[str, Any] = asdict(self.counters)
            out["bytes_saved"] = self.counters.bytes_saved
            out["rejected_by_kind"] = dict(self._rejected_by_kind)
            out["bytes_stored_by_codec"] = dict(self._bytes_by_codec)
        store = asdict(store_stats if store_stats is not None else self.store.stats())
        out.update({k if k in DEMOTION_FIELDS else f"store_{k}": v for k, v in store.items()})
        s = self.settings
        plan = codec_plan(s)
        out["quantization"] = (
            {"bits": s.kv_cache_quantization_bits,
             "group_size": s.kv_cache_quantization_group_size,
             "min_tokens": s.kv_cache_min_quantize_tokens,
             "codec": plan.codec, "codec_setting": s.kv_cache_codec,
             "key_bits": plan.key_bits, "value_bits": plan.value_bits,
             "sink_tokens": plan.sink_tokens, "recent_tokens": plan.recent_tokens,
             "wide_head_keys": plan.wide_head_keys, "window_codec": plan.window_codec,
             "ranked_key_bits": plan.ranked_key_bits,
             "policy": s.kv_cache_quantization_policy}
            if s.kv_cache_quantization else None
        )
        tier = self._cold_tier_stats()
        out["cold_tier"] = tier  # the cold tier's own counters; None: no cold tier
        for name in COLD_FIELDS:  # flat, for /metrics; None: no cold tier (or not kept)
            value = tier.get(name) if tier else None
            out[f"cold_{name}"] = value if isinstance(value, int) else None
        out.update(remote_stats(tier))
        out.update(mlx_memory())
        out.update(self.admission.stats())
        out["host"] = self.host
        out["hot_cache_only"] = s.hot_cache_only
        out["max_kv_size"] = s.max_kv_size
        return out

    def _cold_tier_stats(self) -> dict[str, Any] | None:
        cold = self.store.cold
        cold = getattr(cold, "tier", cold)  # past the shut-down-only wrapper
        stats = getattr(cold, "stats", None)
        if not callable(stats):
            return None
        try:
            return dict(stats())
        except Exception:  # reporting must never fail a request
            return None

    def report(self, **host_fields: Any) -> dict[str, Any]:
        """:meth:`stats` plus every stored entry, from one consistent snapshot, plus the
        host's own fields (``host_version``, ``mode``): what ``GET /kvplugin/stats`` serves."""
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
        out.update(host_fields)
        return out

    def active_line(self, host_version: Any, *, stats_path: str, mode: str | None = None) -> str:
        """The one start-up line every host says: what kvplugin does in this process."""
        s, store = self.settings, self.store
        if s.kv_cache_quantization:
            quant = (f"{s.kv_cache_quantization_bits}-bit entries, group "
                     f"{s.kv_cache_quantization_group_size}, from "
                     f"{s.kv_cache_min_quantize_tokens} tokens, codec {codec_plan(s).description}, "
                     f"policy {s.kv_cache_quantization_policy}")
        else:
            quant = "off"
        budget = ("unlimited" if store.max_bytes >= _UNLIMITED
                  else f"{store.max_bytes / 2**20:.0f} MiB")
        entries = "unlimited" if store.max_entries is None else f"{store.max_entries} entries"
        if getattr(self, "idle_hold", None) is not None:  # a host whose stock holds none
            budget = f"{budget} in memory between requests only, else in the cold tier"
        if s.hot_cache_only:
            cold = "none (--hot-cache-only: evictions are discarded)"
        elif store.cold is not None and (s.ssd_cache_dir or s.remote_url) is not None:
            tiers = [f"{s.ssd_cache_dir} (max {s.ssd_cache_max_gb:g} GB)"] if s.ssd_cache_dir else []
            if s.remote_url:
                tiers.append(f"remote {masked_url(s.remote_url)} (TTL {s.kv_cache_remote_ttl_s} s)")
            cold = " + ".join(tiers)
        elif store.cold is not None:
            cold = type(store.cold).__name__
        else:
            cold = "none (evictions are discarded)"
        bound = f"{s.max_kv_size} tokens" if s.max_kv_size is not None else "unbounded"
        step = f", kv-cache-step {s.kv_cache_step}" if s.kv_cache_step is not None else ""
        where = f" ({mode})" if mode else ""
        salt = "; every request needs a cache_salt" if s.kv_cache_require_salt else ""
        return (f"active on {self.host} {host_version}{where} (prompt cache: {budget}, "
                f"{entries}; quantization: {quant}; max-kv-size: {bound}{step}; cold tier: "
                f"{cold}{salt}; stats: GET {stats_path})")



def describe_entry(model_key: Any, tokens: Sequence[int], cache: list, nbytes: int) -> dict:
    """One stored entry as JSON-able data (``/kvplugin/stats`` of every host)."""
    return {
        "model": str(model_key),
        "tokens": len(tokens),
        "nbytes": int(nbytes),
        "dense_nbytes": sum(dense_nbytes(layer) for layer in cache),
        "layers": [type(layer).__name__ for layer in cache],
        "bits": [layer_bits(layer) for layer in cache],
        "offsets": sorted({int(getattr(layer, "offset", 0) or 0) for layer in cache}),
        "full_precision_tokens": max(map(_protected_rows, cache), default=0),
    }


def _protected_rows(layer: Any) -> int:
    """Tokens a quantized layer also keeps at full precision (sinks, recent, before prompt
    boundaries: the 4th array of its keys), for the operator's view of what an entry costs."""
    keys = getattr(layer, "keys", None)
    return int(keys[3].shape[-2]) if isinstance(keys, (tuple, list)) and len(keys) == 4 else 0


