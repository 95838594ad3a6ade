"""Default storage: the SSD cold tier when a directory is configured, the remote (Redis) tier
when a URL is, both chained (SSD first) when both are; none under ``--hot-cache-only``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from kvplugin.settings import KVPluginSettings
    from kvplugin.types import ColdTier


def entry_format(settings: KVPluginSettings) -> str:
    """What a stored entry's bytes depend on besides the checkpoint: replicas quantizing
    differently must never read each other's entries (the remote tier's namespace)."""
    if not settings.kv_cache_quantization:
        return "full"
    from kvplugin.codecs import codec_plan

    plan = codec_plan(settings)
    return (f"{plan.codec}:k{plan.key_bits}v{plan.value_bits}:g{plan.group_size}"
            f":min{settings.kv_cache_min_quantize_tokens}"
            f":sink{plan.sink_tokens}:recent{plan.recent_tokens}"
            # a ring's protected slots stored once (2026-12-07): older readers delete such entries
            f"{':rings-once' if plan.sink_tokens or plan.recent_tokens else ''}"
            f"{':prerope' if plan.prerope_keys else ''}"
            f"{':wide{}v{}g{}'.format(*plan.wide_head_keys) if plan.wide_head_keys else ''}"
            f"{':window-state-' + plan.window_codec if plan.window_codec else ''}"
            f"{':ranked-k{}'.format(plan.ranked_key_bits) if plan.ranked_key_bits else ''}")


@hookimpl(trylast=True)
def kvplugin_store_backend(settings: KVPluginSettings) -> ColdTier | None:
    if settings.hot_cache_only:  # also when called directly
        return None
    tiers: list = []
    if settings.ssd_cache_dir is not None:
        from kvplugin.cache.tiers.ssd import SSDTier
        from kvplugin.settings import SettingsError

        try:
            tiers.append(SSDTier(settings.ssd_cache_dir, max_bytes=settings.ssd_cache_max_bytes))
        except OSError as e:  # checked at start-up; changed since (another process, a mount)
            raise SettingsError(f"kvplugin: --ssd-cache-dir / KVPLUGIN_SSD_CACHE_DIR: cannot use "
                                f"{settings.ssd_cache_dir}: {e.strerror or e}") from None
    if settings.remote_url is not None:
        from kvplugin.cache.tiers.remote import RemoteTier

        tiers.append(RemoteTier(
            settings.remote_url, entry_format=entry_format(settings),
            timeout_ms=settings.kv_cache_remote_timeout_ms,
            fetch_timeout_ms=settings.kv_cache_remote_fetch_timeout_ms,
            ttl_s=settings.kv_cache_remote_ttl_s,
            block_tokens=settings.kv_cache_remote_block_tokens,
            max_value_bytes=int(settings.kv_cache_remote_max_value_mb * 1e6),
            queue_bytes=int(settings.kv_cache_remote_queue_mb * 1e6)))
    if len(tiers) > 1:
        from kvplugin.cache.tiers.chain import TierChain

        return TierChain(tiers)
    return tiers[0] if tiers else None
