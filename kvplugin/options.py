"""argparse glue any host adapter can use.

``add_options(parser)`` puts every kvplugin option on a host's parser. Where the host
already defines an option of the same spelling (vllm-mlx has several), that action is
*adopted* instead of added — argparse raises on duplicates — and its default is set to
``None`` so "not given" can be told apart from "given", which flag > env > default needs.
Adopted options lose their ``choices``: kvplugin validates (and widens, e.g. bits 2..8).

``settings_from_namespace(parser, namespace)`` resolves the settings and writes every
resolved value back into the namespace under the host's own ``dest`` so host code that
reads its namespace sees the same values kvplugin uses.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from kvplugin.settings import KVPluginSettings, OptionInfo, option_infos, resolve_settings

_DESTS_ATTR = "_kvplugin_dests"
GROUP_TITLE = "kvplugin (KV-cache memory; every option also from its KVPLUGIN_* variable)"

_TYPES = {
    "kv_cache_quantization_bits": int,
    "kv_cache_quantization_group_size": int,
    "kv_cache_min_quantize_tokens": int,
    "kv_cache_codec": str,
    "kv_cache_quantization_policy": str,
    "kv_cache_key_bits": int,
    "kv_cache_sink_tokens": int,
    "kv_cache_recent_tokens": int,
    "kv_cache_value_bits": int,
    "max_kv_size": int,
    "kv_cache_step": int,
    "max_memory": str,
    "ssd_cache_dir": Path,
    "ssd_cache_max_gb": float,
    "kv_cache_remote": str,
    "kv_cache_remote_timeout_ms": int,
    "kv_cache_remote_fetch_timeout_ms": int,
    "kv_cache_remote_ttl_s": int,
    "kv_cache_remote_block_tokens": int,
    "kv_cache_remote_max_value_mb": float,
    "kv_cache_remote_queue_mb": float,
}

_METAVARS = {
    "kv_cache_quantization_bits": "BITS",
    "kv_cache_quantization_group_size": "SIZE",
    "kv_cache_min_quantize_tokens": "TOKENS",
    "kv_cache_codec": "NAME",
    "kv_cache_quantization_policy": "POLICY",
    "kv_cache_key_bits": "BITS",
    "kv_cache_sink_tokens": "TOKENS",
    "kv_cache_recent_tokens": "TOKENS",
    "kv_cache_value_bits": "BITS",
    "max_kv_size": "TOKENS",
    "kv_cache_step": "TOKENS",
    "max_memory": "SIZE",
    "ssd_cache_dir": "DIR",
    "ssd_cache_max_gb": "GB",
    "kv_cache_remote": "URL",
    "kv_cache_remote_timeout_ms": "MS",
    "kv_cache_remote_fetch_timeout_ms": "MS",
    "kv_cache_remote_ttl_s": "SECONDS",
    "kv_cache_remote_block_tokens": "TOKENS",
    "kv_cache_remote_max_value_mb": "MB",
    "kv_cache_remote_queue_mb": "MB",
}


def _help(info: OptionInfo, host_help: str | None = None) -> str:
    text = host_help or info.help
    allowed = f" Allowed: {info.allowed}." if info.allowed and not info.is_bool else ""
    return f"{text}{allowed} [env: {info.env}]".replace("%", "%%")


def add_options(
    parser: argparse.ArgumentParser,
    *,
    only: Iterable[str] | None = None,
    description: str | None = None,
) -> dict[str, str]:
    """Add (or adopt) kvplugin's options on ``parser``; return ``{field: dest}``.

    ``only`` restricts the fields handled (by field name). ``description`` heads kvplugin's
    group in ``--help`` (a host says there how its own flags relate). Calling twice is
    harmless.
    """
    dests: dict[str, str] = getattr(parser, _DESTS_ATTR, {})
    wanted = set(only) if only is not None else None
    group = None
    for info in option_infos():
        if (wanted is not None and info.field not in wanted) or info.field in dests:
            continue
        existing = parser._option_string_actions.get(info.flag)  # argparse has no public API
        if existing is not None:
            _adopt(existing, info)
            dests[info.field] = existing.dest
            continue
        if group is None:
            group = parser.add_argument_group(
                GROUP_TITLE, description.replace("%", "%%") if description else None)
        if info.is_bool:
            action = group.add_argument(
                info.flag,
                dest=info.field,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_help(info),
            )
        else:
            action = group.add_argument(
                info.flag,
                dest=info.field,
                type=_TYPES[info.field],
                default=None,
                metavar=_METAVARS[info.field],
                help=_help(info),
            )
        dests[info.field] = action.dest
    setattr(parser, _DESTS_ATTR, dests)
    return dests


def _adopt(action: argparse.Action, info: OptionInfo) -> None:
    """Take over a host-defined option: defaults to 'not given', kvplugin validates."""
    action.default = None
    action.choices = None
    if not info.is_bool and info.field in _TYPES:
        action.type = _TYPES[info.field]
    action.help = _help(info, action.help if action.help != argparse.SUPPRESS else None)


def given_flags(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> dict:
    """The kvplugin options the user passed on the command line (field -> value)."""
    dests: dict[str, str] = getattr(parser, _DESTS_ATTR, {})
    return {
        field: getattr(namespace, dest)
        for field, dest in dests.items()
        if getattr(namespace, dest, None) is not None
    }


def settings_from_namespace(
    parser: argparse.ArgumentParser, namespace: argparse.Namespace
) -> KVPluginSettings:
    """Resolve settings (flag > env > default) and write them back into ``namespace``.

    Raises :class:`kvplugin.settings.SettingsError` on bad input; host adapters turn it
    into ``parser.error`` so the host exits at start-up with the message.
    """
    settings = resolve_settings(given_flags(parser, namespace))
    for field, dest in getattr(parser, _DESTS_ATTR, {}).items():
        setattr(namespace, dest, _host_value(settings, field))
    return settings


def _host_value(settings: KVPluginSettings, field: str) -> object:
    """The value host code must see: under ``--hot-cache-only`` a host's own SSD cache
    (vllm-mlx reads ``--ssd-cache-dir`` itself) gets no directory either."""
    if field == "ssd_cache_dir":
        return settings.cold_tier_dir
    return getattr(settings, field)
