"""What a host may read of the service's store and admission, and tell it: the front desk's
counter, so no host reaches into :class:`PromptStore` or :class:`AdmissionControl` itself.

Why apart from the front desk: these decide nothing; they answer a host's interface (the
entry count and byte gauges a host's scheduler reads, its own trim and clear calls, a request
to admit) in the engine's terms.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

__all__ = ["Holdings"]


class Holdings:
    """The store and admission as a host sees them (a mixin: it reads the service's
    ``store`` and ``admission``)."""

    @property
    def entries_held(self) -> int:
        """How many entries the hot store holds."""
        return len(self.store)

    @property
    def bytes_held(self) -> int:
        """The bytes of the hot store's entries."""
        return self.store.nbytes

    @property
    def budget_bytes(self) -> int:
        """The hot store's byte budget (the host's own, when it passed one)."""
        return self.store.max_bytes

    def trim_to(self, *, n_bytes: int | None = None, n_entries: int | None = None) -> None:
        """The host asks the hot store down to ``n_bytes`` / ``n_entries``: least recently used
        entries are evicted, and spill to the cold tier like any eviction."""
        self.store.trim_to(n_bytes=n_bytes, n_entries=n_entries)

    def drop_all(self) -> None:
        """The host clears its prompt cache: every hot entry is dropped, none spilled."""
        self.store.drop_all()

    def store_stats(self) -> Any:
        """The hot store's counters (:class:`~kvplugin.cache.store.stats.StoreStats`)."""
        return self.store.stats()

    @property
    def admission_on(self) -> bool:
        """Whether requests are admitted against a memory limit (``--max-memory``)."""
        return self.admission.ledger is not None

    def admit(self, key: Hashable, model: Any, *, prompt_tokens: int, max_tokens: int,
              prefill_chunk: int, batched: bool = False) -> Any:
        """Admit request ``key`` or raise
        :class:`~kvplugin.cache.memory.footprint.AdmissionRefused` (the host answers its
        verdict); :meth:`request_done` releases it."""
        return self.admission.admit(key, model, prompt_tokens=prompt_tokens,
                                    max_tokens=max_tokens, prefill_chunk=prefill_chunk,
                                    batched=batched)

    def learn_live_quantization(self, bits: int, group_size: int, start: int) -> None:
        """The host quantizes its live caches (``bits``, ``group_size``, from token ``start``):
        stored layers quantized that way are handed back as they are (``dequantize``)."""
        self.live_quantization = (int(bits), int(group_size), int(start))
