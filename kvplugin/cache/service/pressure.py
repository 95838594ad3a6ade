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

from kvplugin.cache.layers import entry_nbytes, layer_bits

__all__ = ["fit_at_insert", "is_quantized", "quantize_at_store", "quantizes_at_store", "store_demotion"]


def quantizes_at_store(settings: Any) -> bool:
    """Whether an entry is quantized as it is stored (``always``), not later under pressure."""
    return bool(settings.kv_cache_quantization) and (
        settings.kv_cache_quantization_policy != "pressure")


def store_demotion(service: Any) -> dict[str, Any]:
    """``demote`` and ``on_demote`` for the store under the pressure policy; {} otherwise."""
    settings = service.settings
    if not settings.kv_cache_quantization or settings.kv_cache_quantization_policy != "pressure":
        return {}

    def demote(model_key: Any, tokens: Sequence[int], cache: list,
               stored_prefix: list | None = None) -> list | None:
        return _quantize(service, model_key, tokens, cache, len(tokens), stored_prefix)

    def on_demote(tokens: Sequence[int], cache: list, seconds: float) -> None:
        service._event("demote", len(tokens), cache, seconds)

    return {"demote": demote, "on_demote": on_demote}


def quantize_at_store(service: Any, model_key: Any, tokens: Sequence[int], entry: list,
                      num_tokens: int, stored_prefix: list | None) -> tuple[list, bool]:
    """``entry`` as it is prepared for the store, and whether it was quantized: under
    ``always`` quantized, under ``pressure`` only where the budget cannot hold it at full
    precision (:func:`fit_at_insert`). ``stored_prefix``: the conversation's entry as the codec
    stored it, whose rows are copied rather than quantized again, so that a turn's codec work
    follows the tokens it adds."""
    if quantizes_at_store(service.settings):
        quantized = _quantize(service, model_key, tokens, entry, num_tokens, stored_prefix)
        if quantized is None:
            return entry, False
        service._event("quantize", num_tokens, quantized)
        return quantized, True
    if model_key is None or not tokens or is_quantized(entry):
        return entry, False
    return fit_at_insert(service, model_key, tokens, entry, stored_prefix)


def _quantize(service: Any, model_key: Any, tokens: Sequence[int], entry: list,
              num_tokens: int, stored_prefix: list | None) -> list | None:
    """The configured codec on ``entry`` (None: declined), for a store and a demotion alike.
    The codec's temporaries stay in MLX's buffer cache, where the next prefill's buffers of
    other sizes would stack on them: handed back at once instead."""
    quantized = service.hook.kvplugin_quantize_entry(
        cache=entry, num_tokens=num_tokens, settings=service.settings,
        prompt_boundaries=service._recent_prompts.boundaries(model_key, tokens),
        stored_prefix=stored_prefix, key_ropes=service.key_ropes,
    )
    if quantized is not None:
        service.release_memory()
    return quantized


def is_quantized(entry: list) -> bool:
    """Whether any layer of ``entry`` is stored quantized."""
    return any(layer_bits(layer) is not None for layer in entry)


def fit_at_insert(service: Any, model_key: Any, tokens: Sequence[int], entry: list,
                  stored_prefix: list | None = None) -> tuple[list, bool]:
    """``entry`` as the store takes it under the pressure policy, and whether it was demoted
    here: as it is where the budget holds it at full precision, else quantized on this thread
    (as ``always`` stores it, copying ``stored_prefix``'s rows) before it is evaluated,
    because a batched host hands a lazy copy of rows its live batch still holds, and
    evaluating it at full precision would hold both."""
    store, nbytes = service.store, entry_nbytes(entry)
    if store.demote is None:
        return entry, False
    if is_quantized(entry):  # quantized as it was prepared: a demoted entry to the store
        return entry, True
    if store.fits_at_full_precision(model_key, tokens, nbytes):
        if store.above_high_water(nbytes):
            # under pressure its copy is not made on buffers MLX keeps cached (as ``always``
            # hands them back after each store's quantize)
            service.release_memory()
        return entry, False
    start = time.perf_counter()
    quantized = store.demote_at_insert(model_key, tokens, entry, stored_prefix)
    if quantized is None:
        return entry, False
    service._event("quantize", len(tokens), quantized, time.perf_counter() - start)
    return quantized, True
