"""What kvplugin refuses before a host serves: checks on the model, the host's options and
the patching, each one message naming the flag and the environment variable.

Why a module of its own: the hosts call these at start-up, before any session exists (a
group size checked against ``config.json`` before the weights load, an option combination
refused before the server listens); they decide, the adapters only report.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from kvplugin.settings import KVPluginSettings, option_info

__all__ = ["host_option_conflict", "model_problem", "unpatched_problem"]

_GROUP_FIELD = "kv_cache_quantization_group_size"


def model_problem(model: Any, settings: KVPluginSettings | None,
                  given_flags: Collection[str] = ()) -> str | None:
    """Why kvplugin cannot serve ``model`` with ``settings`` (one message), or ``None``.

    ``model`` is a loaded model or a ``{"args": config.json}`` dict (checked before the
    weights load). ``given_flags``: setting fields given as flags, so the message names
    where the bad value came from (flag, variable or default).
    """
    if settings is None or not settings.kv_cache_quantization or model is None:
        return None
    from kvplugin.cache.model.widths import validate_group_size_for_model

    problem = _codec_problem(model, settings, given_flags)
    if problem:
        return problem
    group = settings.kv_cache_quantization_group_size
    try:
        left = validate_group_size_for_model(model, group)
        if left:
            from kvplugin.log import say

            say(f"--kv-cache-quantization-group-size {group} does not divide the cache's "
                f"{', '.join(left)}: those stay full precision, the rest is quantized",
                key=f"group-partial:{group}:{left}")
    except ValueError as exc:
        info = option_info(_GROUP_FIELD)
        if _GROUP_FIELD in given_flags:
            got = f"{info.flag} {group}"
        elif os.environ.get(info.env):
            got = f"{info.env}={os.environ[info.env]}"
        else:
            got = f"the default {group}"
        return (
            f"kvplugin: invalid value for {info.flag} / {info.env}: got {got} ({exc}); "
            f"the server cannot quantize this model's KV cache"
        )
    return None


def _codec_problem(model: Any, settings: KVPluginSettings,
                   given_flags: Collection[str]) -> str | None:
    """A codec the user named (not ``auto``) that this model's cache widths cannot take, on
    plain and rotating layers alike: refused rather than stored with another codec."""
    from kvplugin.cache.model.widths import cache_widths
    from kvplugin.codecs import fitting_codec

    codec, widths = settings.kv_cache_codec, cache_widths(model)
    if codec == "auto" or not widths:
        return None
    key_width, value_width = (list(widths.values()) * 2)[:2]
    fits = fitting_codec(codec, key_width, value_width)
    if fits == codec:
        return None
    field = "kv_cache_codec"
    info = option_info(field)
    got = (f"{info.flag} {codec}" if field in given_flags else f"{info.env}={codec}")
    return (f"kvplugin: invalid value for {info.flag} / {info.env}: got {got} (this model's "
            f"cache widths {'/'.join(map(str, sorted(set(widths.values()))))} can only take "
            f"{fits}: {codec} needs power-of-two widths"
            f"{', keys a multiple of 32' if fits == 'rotated' else ''}); use {fits} or auto")


def host_option_conflict(settings: KVPluginSettings, host_options: Mapping[str, Any]) -> str | None:
    """A host option kvplugin's settings cannot be served with (one message), or ``None``.

    ``host_options``: the host's parsed values by name (``kv_bits``, ``draft_model``).
    """
    if settings.max_kv_size is None:
        return None
    if host_options.get("kv_bits") is not None:
        return ("kvplugin: --max-kv-size (KVPLUGIN_MAX_KV_SIZE) cannot be combined with "
                "mlx-lm's --kv-bits: mlx-lm cannot quantize a rotating (bounded) cache")
    if host_options.get("draft_model"):
        return ("kvplugin: --max-kv-size (KVPLUGIN_MAX_KV_SIZE) cannot be combined with "
                "--draft-model: speculative decoding trims the cache, and a bounded cache "
                "cannot be trimmed once it is full")
    return None


def unpatched_problem(settings: Any, host: str) -> str | None:
    """Why the host must not start when kvplugin could not patch its serving path, or None.

    Serving stock is acceptable (the user gets the host's own cache) except under
    ``--hot-cache-only``: a stock host would write its prompt cache to disk, the one thing
    that flag promises will not happen. Fail closed.
    """
    if settings is not None and settings.hot_cache_only:
        return (
            "kvplugin: --hot-cache-only (KVPLUGIN_HOT_CACHE_ONLY) cannot be honoured "
            f"because kvplugin could not patch {host} (see above); not starting"
        )
    return None
