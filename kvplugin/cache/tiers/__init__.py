"""Cold tiers behind the hot one: the SSD directory (``ssd``), Redis (``remote``), chained."""

from __future__ import annotations

from typing import Any

#: The remote tier's counters, flat in the stats and /metrics (``remote_<name>``).
REMOTE_FIELDS = ("hits", "misses", "errors", "timeouts", "corrupt", "stale", "invalid",
                 "too_large", "refused", "dropped", "puts", "bytes_read", "bytes_written",
                 "fetches", "fetch_seconds", "connected", "queued_bytes", "url")


def remote_stats(tier_stats: dict[str, Any] | None) -> dict[str, Any]:
    """``remote_<name>`` for every field: the tier's value, ``None`` without a remote tier."""
    tier_stats = tier_stats or {}
    return {f"remote_{n}": tier_stats.get(f"remote_{n}") for n in REMOTE_FIELDS}
