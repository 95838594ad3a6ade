"""Where each setting came from, and the start-up lines a setting owes when it changed
another's meaning: for ``kvplugin info`` and every host's start-up.

Why apart from the settings model: the model validates values; this explains them, reading
the same sources without building the settings again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvplugin.config_sources import ConfigFile
from kvplugin.settings import (QUANTIZATION_DETAILS, KVPluginSettings, Source, _config_file,
                               option_info, option_infos)

__all__ = ["config_file_in_force", "notices", "setting_sources"]


def config_file_in_force() -> ConfigFile | None:
    """The configuration file :func:`resolve_settings` reads now (for ``kvplugin info``)."""
    return _config_file()[0]


def setting_sources(flags: Mapping[str, Any] | None = None) -> dict[str, Source]:
    """Where each option's value comes from, for ``kvplugin info`` and logs.

    ``implied`` marks quantization switched on by a bits/group/threshold setting.
    """
    given = {k for k, v in (flags or {}).items() if v is not None}
    _, file_data = _config_file()
    sources: dict[str, Source] = {}
    for info in option_infos():
        if info.field in given:
            sources[info.field] = "flag"
        elif os.environ.get(info.env, "").strip():
            sources[info.field] = "env"
        elif info.field in file_data:
            sources[info.field] = "file"
        else:
            sources[info.field] = "default"
    if sources["kv_cache_quantization"] == "default" and any(
        sources[name] != "default" for name in QUANTIZATION_DETAILS
    ):
        sources["kv_cache_quantization"] = "implied"
    return sources


def notices(settings: KVPluginSettings, sources: Mapping[str, Source]) -> list[str]:
    """Lines the host prints once at start-up where a setting changed another's meaning."""
    out = []
    if sources.get("kv_cache_quantization") == "implied":
        detail = next(
            option_info(n) for n in QUANTIZATION_DETAILS if sources.get(n) != "default"
        )
        out.append(
            f"{detail.flag} ({detail.env}) turns entry quantization on "
            f"(--kv-cache-quantization); pass --no-kv-cache-quantization to keep it off"
        )
    if settings.hot_cache_only and settings.ssd_cache_dir is not None:
        out.append(
            f"--hot-cache-only wins: the SSD directory {settings.ssd_cache_dir} "
            f"(--ssd-cache-dir / KVPLUGIN_SSD_CACHE_DIR) is not used, nothing is written to disk"
        )
    if settings.hot_cache_only and settings.kv_cache_remote is not None:
        out.append(
            "--hot-cache-only wins: the remote tier (--kv-cache-remote / "
            "KVPLUGIN_KV_CACHE_REMOTE) is not used, nothing leaves the process"
        )
    return out
