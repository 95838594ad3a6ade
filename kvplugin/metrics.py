"""kvplugin's Prometheus series, built from :meth:`KVService.stats`, for every host.

One table of series for both hosts: vllm-mlx registers :class:`KVCollector` on its own
``/metrics`` registry; mlx-lm has no ``/metrics``, so kvplugin serves one with only these
series (:func:`exposition`). Only what kvplugin measures is exported — never the host's own
counters relabelled as ours. A series whose stats key is absent or ``None`` (a tier that is
not configured) has no sample rather than a made-up value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

METRICS_PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: (metric name without ``kvplugin_``, help, key of ``KVService.stats()``)
COUNTERS = (
    ("entries_stored", "Prompt-cache entries kvplugin prepared for storage.", "entries_stored"),
    ("entries_quantized", "Entries stored quantized.", "entries_quantized"),
    ("bytes_saved", "Bytes saved by trimming and quantization (live size - stored size).",
     "bytes_saved"),
    ("hits", "Prompt-cache lookups that reused a stored prefix.", "store_hits"),
    ("misses", "Prompt-cache lookups without a usable prefix.", "store_misses"),
    ("evictions", "Entries evicted from the hot tier.", "store_evictions"),
    ("spills", "Evicted entries written to the cold (SSD) tier.", "store_spills"),
    ("cold_hits", "Hits served from the cold (SSD) tier.", "store_cold_hits"),
    ("discarded", "Evicted entries dropped (no cold tier, or it refused).", "store_discarded"),
    ("superseded", "Entries replaced by a longer one of the same conversation.",
     "store_superseded"),
    ("tokens_reused", "Prompt tokens served from the cache.", "store_tokens_reused"),
    ("entries_invalid", "Fetched cold-tier entries that did not fit the model (layer count, "
     "kind, dtype or width): never served.", "entries_invalid"),
    ("memory_releases", "Times kvplugin emptied MLX's buffer cache (after evictions and after "
     "quantizing or dequantizing an entry).", "memory_releases"),
    ("bytes_released", "Bytes those releases handed back to the system (MLX buffer cache).",
     "bytes_released"),
    ("admitted", "Requests admission control admitted (--max-memory).", "admitted"),
    ("refused_too_large", "Requests refused with 413: they can never fit under --max-memory.",
     "refused_too_large"),
    ("refused_busy", "Requests refused with 503: requests in flight held the memory.",
     "refused_busy"),
    ("pressure_evictions", "Stored entries evicted to admit a request.", "pressure_evictions"),
    ("demotions", "Stored entries quantized in place under --kv-cache-quantization-policy "
     "pressure, instead of being evicted.", "demotions"),
    ("demotions_at_insert", "Entries quantized as they were stored under the pressure policy: "
     "the budget could not hold them at full precision.", "demotions_at_insert"),
    ("evictions_full", "Entries evicted at full precision under the pressure policy: an insert "
     "or admission needed the room before the demotion worker had made it.", "evictions_full"),
    ("bytes_saved_by_demotion", "Bytes demotions took off stored entries (full precision - "
     "quantized).", "bytes_saved_by_demotion"),
    ("hits_full", "Hot hits served from a full-precision entry (a move, no restore).",
     "hits_full"),
    ("hits_demoted", "Hot hits served from an entry demoted under pressure (restored).",
     "hits_demoted"),
    ("lent_copies", "Hits served from a copy of an entry lent to a request in flight "
     "(contention; stock deep-copies).", "store_lent_copies"),
    ("cold_corrupt", "Cold-tier files whose data failed its digest or header check (removed, "
     "never served; no sample: no cold tier).", "cold_corrupt"),
    ("cold_unreadable", "Cold-tier files that could not be read (I/O error; no sample: no "
     "cold tier).", "cold_unreadable"),
    ("cold_refused", "Entries the cold tier did not write (unsupported, too big, read-only, "
     "write failures; no sample: no cold tier).", "cold_refused"),
    ("cold_puts", "Entry files the cold tier wrote (no sample: no cold tier).", "cold_puts"),
    ("cold_evictions", "Entry files this process removed to keep the directory's budget, any "
     "process's (no sample: no cold tier).", "cold_evictions"),
    ("cold_write_failures", "Cold-tier writes that failed (I/O error, full disk after making "
     "room; no sample: no cold tier).", "cold_write_failures"),
    ("cold_leftovers_removed", "Temp files of dead writers removed from the cold tier (no "
     "sample: no cold tier).", "cold_leftovers_removed"),
    ("remote_hits", "Lookups the remote (Redis) tier answered with a usable prefix (no "
     "sample: no remote tier).", "remote_hits"),
    ("remote_misses", "Remote-tier lookups without a usable prefix, Redis down or slow "
     "included (no sample: no remote tier).", "remote_misses"),
    ("remote_errors", "Remote-tier operations that failed (connection, full, refused).",
     "remote_errors"),
    ("remote_timeouts", "Remote-tier fetches past --kv-cache-remote-fetch-timeout-ms.",
     "remote_timeouts"),
    ("remote_corrupt", "Remote values that failed the digest, size, namespace or token check "
     "(deleted, never served).", "remote_corrupt"),
    ("remote_dropped", "Entries not written to the remote tier: Redis down, or the write "
     "queue full.", "remote_dropped"),
    ("remote_puts", "Entries written to the remote tier.", "remote_puts"),
    ("remote_read_bytes", "Bytes read from the remote tier.", "remote_bytes_read"),
    ("remote_written_bytes", "Bytes written to the remote tier.", "remote_bytes_written"),
    ("remote_fetch_seconds", "Seconds requests spent waiting on remote-tier fetches (divide "
     "by kvplugin_remote_fetches for the mean latency).", "remote_fetch_seconds"),
    ("remote_fetches", "Remote-tier fetches (hits + misses while reachable).",
     "remote_fetches"),
)
GAUGES = (
    ("entries", "Entries in the hot tier.", "store_entries"),
    ("bytes", "Bytes held by the hot tier.", "store_bytes"),
    ("cold_entries", "Entries in the cold tier (no sample: no cold tier).", "store_cold_entries"),
    ("cold_bytes", "Bytes in the cold tier (no sample: no cold tier).", "store_cold_bytes"),
    ("cold_disk_bytes", "Bytes on disk in the cold tier's directory, every process and model "
     "sharing it, at the last scan (no sample: no cold tier).", "cold_disk_bytes"),
    ("cold_symlinks", "Symlinks the cold tier found in place of entries and skipped (no "
     "sample: no cold tier).", "cold_symlinks"),
    ("max_memory_bytes", "The admission limit in force (--max-memory; no sample: off).",
     "max_memory"),
    ("admission_reserved_bytes", "Bytes reserved by requests in flight (no sample: off).",
     "admission_reserved"),
    ("mlx_active_bytes", "MLX active memory of the whole process (arrays alive), as MLX reports.",
     "mlx_active_memory"),
    ("mlx_cache_bytes", "MLX buffer cache of the whole process (freed, not yet returned).",
     "mlx_cache_memory"),
    ("remote_connected", "1 while the remote tier is reachable, 0 while it backs off (no "
     "sample: no remote tier).", "remote_connected"),
    ("remote_queued_bytes", "Bytes waiting to be written to the remote tier.",
     "remote_queued_bytes"),
)


def families(stats: Mapping[str, Any]) -> Iterator[Any]:
    """One metric family per series; a sample only where ``stats`` has a value."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, text, key in COUNTERS:
        fam = CounterMetricFamily(f"kvplugin_{name}", text)
        if stats.get(key) is not None:
            fam.add_metric([], float(stats[key]))
        yield fam
    for name, text, key in GAUGES:
        gauge = GaugeMetricFamily(f"kvplugin_{name}", text)
        if stats.get(key) is not None:
            gauge.add_metric([], float(stats[key]))
        yield gauge


class KVCollector:
    """A Prometheus collector reading the session's stats at scrape time."""

    def __init__(self, stats_of: Callable[[], Mapping[str, Any] | None]) -> None:
        self._stats_of = stats_of

    def describe(self) -> list:
        return list(families({}))

    def collect(self) -> list:
        return list(families(self._stats_of() or {}))


def exposition(stats: Mapping[str, Any]) -> bytes:
    """The Prometheus text format of kvplugin's series alone (mlx-lm's ``/metrics``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVCollector(lambda: stats))
    return generate_latest(registry)
