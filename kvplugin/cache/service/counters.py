"""What the service counts of its own, and the batch plan it hands hosts (plain records)."""

from __future__ import annotations

from dataclasses import dataclass

from kvplugin.cache.layers import layer_bits

__all__ = ["BatchPlan", "Counters", "entry_codec"]


@dataclass
class Counters:
    """kvplugin's own counters (the store's hits/misses/evictions come from the store)."""

    entries_stored: int = 0
    entries_quantized: int = 0
    bytes_before: int = 0  # what the host would have stored (live cache, with slack)
    bytes_stored: int = 0  # what kvplugin stored (trimmed, maybe quantized)
    caches_made: int = 0
    caches_bounded: int = 0
    entries_rejected: int = 0  # finished caches kvplugin could not store (see rejected_by_kind)
    entries_invalid: int = 0  # fetched entries that did not fit the model (never served)
    memory_releases: int = 0  # MLX buffer-cache releases after evictions and codec passes
    bytes_released: int = 0  # bytes those releases handed back to the system
    layers_handed_back_quantized: int = 0  # quantized as the host's --kv-bits live cache is

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_stored


@dataclass(frozen=True)
class BatchPlan:
    """How a host's batched path runs: the class ``step`` of each batch cache (by class name)
    and the bound every fresh per-request cache gets (None: not bounded)."""

    steps: dict[str, int]
    bound: int | None


def entry_codec(entry: list) -> str:
    """``"full"`` for an entry stored at full precision, else its layers' codec names
    (``rotated-k4v4``; several joined by ``+`` when layers differ)."""
    from kvplugin.cache.codec.quantize import codec_name

    names = sorted({codec_name(layer) for layer in entry if layer_bits(layer) is not None})
    return "+".join(names) if names else "full"
