"""Default bound: ``--max-kv-size`` rotating caches grown up to the bound, ``--kv-cache-step``
growth."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvplugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from kvplugin.settings import KVPluginSettings


@hookimpl(trylast=True)
def kvplugin_make_cache(model: Any, cache: list, settings: KVPluginSettings) -> list | None:
    from kvplugin.cache.bounded import prealloc

    if settings.max_kv_size is not None:
        bounded, _ = prealloc.bound_cache(cache, settings.max_kv_size)
        return bounded
    if settings.kv_cache_step is not None:
        return prealloc.apply_growth_step(cache, settings.kv_cache_step)
    return None
