"""The pressure policy's side of the front desk: the codec and observer the store demotes with.

Why apart: :class:`~kvplugin.cache.store.prompt_store.PromptStore` decides when an entry is
demoted (:mod:`kvplugin.cache.store.demotion`) and imports no codec; what demoting means (the
configured codec through ``kvplugin_quantize_entry``, as a stored entry gets under ``always``)
is the service's, and lives here so the service's own module stays one job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvplugin.cache.layers import entry_nbytes

__all__ = ["fit_at_insert", "quantizes_at_store", "store_demotion"]


def quantizes_at_store(settings: Any) -> bool:
    """Whether an entry is quantized as it is stored (``always``), not later under pressure."""
    return bool(settings.kv_cache_quantization) and (
        settings.kv_cache_quantization_policy != "pressure")


def store_demotion(service: Any) -> dict[str, Any]:
    """``demote`` and ``on_demote`` for the store under the pressure policy; {} otherwise."""
    settings = service.settings
    if not settings.kv_cache_quantization or settings.kv_cache_quantization_policy != "pressure":
        return {}

    def demote(model_key: Any, tokens: Sequence[int], cache: list) -> list | None:
        quantized = service.hook.kvplugin_quantize_entry(
            cache=cache, num_tokens=len(tokens), settings=settings,
            prompt_boundaries=service._recent_prompts.boundaries(model_key, tokens),
            stored_prefix=None, key_ropes=service.key_ropes,
        )
        if quantized is not None:
            service.release_memory()  # the codec's temporaries, as after a store's quantize
        return quantized

    def on_demote(tokens: Sequence[int], cache: list, seconds: float) -> None:
        service._event("demote", len(tokens), cache, seconds)

    return {"demote": demote, "on_demote": on_demote}


def fit_at_insert(service: Any, model_key: Any, tokens: Sequence[int],
                  entry: list) -> tuple[list, bool]:
    """``entry`` as the store takes it under the pressure policy, and whether it was demoted
    here: as it is where the budget holds it at full precision, else quantized on this thread
    (as ``always`` stores it) before it is evaluated, because a batched host hands a lazy copy
    of rows its live batch still holds, and evaluating it at full precision would hold both."""
    store, nbytes = service.store, entry_nbytes(entry)
    if store.demote is None:
        return entry, False
    if store.fits_at_full_precision(model_key, tokens, nbytes):
        if store.above_high_water(nbytes):
            # under pressure its copy is not made on buffers MLX keeps cached (as ``always``
            # hands them back after each store's quantize)
            service.release_memory()
        return entry, False
    start = time.perf_counter()
    quantized = store.demote_at_insert(model_key, tokens, entry)
    if quantized is None:
        return entry, False
    service._event("quantize", len(tokens), quantized, time.perf_counter() - start)
    return quantized, True
