"""The pressure policy's side of the front desk: the codec and observer the store demotes with.

Why apart: :class:`~kvplugin.cache.store.prompt_store.PromptStore` decides when an entry is
demoted (:mod:`kvplugin.cache.store.demotion`) and imports no codec; what demoting means (the
configured codec through ``kvplugin_quantize_entry``, as a stored entry gets under ``always``)
is the service's, and lives here so the service's own module stays one job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["quantizes_at_store", "store_demotion"]


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
