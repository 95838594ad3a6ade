"""kvplugin's default strategies: ordinary hook implementations over the engine modules.

Every implementation is ``trylast`` so that an installed plugin runs first and overrides
it by returning a non-``None`` value. Engine modules are imported lazily: registering the
built-ins must not load mlx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvplugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from kvplugin.cache.store import ColdTier, StoreEntry
    from kvplugin.settings import KVPluginSettings


@hookimpl(trylast=True)
def kvplugin_make_cache(model: Any, cache: list, settings: KVPluginSettings) -> list | None:
    from kvplugin.cache import prealloc

    if settings.max_kv_size is not None:
        bounded, _ = prealloc.bound_cache(cache, settings.max_kv_size)
        return bounded
    if settings.kv_cache_step is not None:
        return prealloc.apply_growth_step(cache, settings.kv_cache_step)
    return None


@hookimpl(trylast=True)
def kvplugin_trim_entry(cache: list) -> list | None:
    from kvplugin.cache import trim

    return trim.trim_entry(cache)


@hookimpl(trylast=True)
def kvplugin_quantize_entry(
    cache: list, num_tokens: int, settings: KVPluginSettings
) -> list | None:
    from kvplugin.cache import quantize

    if num_tokens < settings.kv_cache_min_quantize_tokens:
        return None
    result = quantize.quantize_entry(
        cache,
        bits=settings.kv_cache_quantization_bits,
        group_size=settings.kv_cache_quantization_group_size,
    )
    return result.cache if result.quantized else None


@hookimpl(trylast=True)
def kvplugin_dequantize_entry(cache: list, settings: KVPluginSettings) -> list | None:
    from kvplugin.cache import quantize

    return quantize.dequantize_entry(cache)


@hookimpl(trylast=True)
def kvplugin_store_backend(settings: KVPluginSettings) -> ColdTier | None:
    if settings.hot_cache_only or settings.ssd_cache_dir is None:
        return None
    from kvplugin.cache.store import SSDTier

    return SSDTier(settings.ssd_cache_dir, max_bytes=settings.ssd_cache_max_bytes)


@hookimpl(trylast=True)
def kvplugin_on_evict(entry: StoreEntry, settings: KVPluginSettings) -> None:
    """Nothing to do by default: the store itself spills or discards."""
