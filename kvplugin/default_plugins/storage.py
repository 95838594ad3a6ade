"""Default storage: the SSD cold tier when a directory is configured, else none."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from kvplugin.settings import KVPluginSettings
    from kvplugin.types import ColdTier


@hookimpl(trylast=True)
def kvplugin_store_backend(settings: KVPluginSettings) -> ColdTier | None:
    if settings.hot_cache_only or settings.ssd_cache_dir is None:  # also when called directly
        return None
    from kvplugin.cache.tiers.ssd import SSDTier

    return SSDTier(settings.ssd_cache_dir, max_bytes=settings.ssd_cache_max_bytes)
