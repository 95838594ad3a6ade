"""Default quantize codec: mlx-lm's ``QuantizedKVCache`` at the configured codec, key/value
bits and group (see :mod:`kvplugin.cache.quantize`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from kvplugin.settings import KVPluginSettings


@hookimpl(trylast=True)
def kvplugin_quantize_entry(
    cache: list, num_tokens: int, settings: KVPluginSettings
) -> list | None:
    from kvplugin.cache import quantize

    if num_tokens < settings.kv_cache_min_quantize_tokens:
        return None
    bits = settings.kv_cache_quantization_bits
    value_bits = settings.kv_cache_value_bits
    result = quantize.quantize_entry(
        cache,
        bits=settings.kv_cache_key_bits or bits,
        value_bits=value_bits or bits,
        codec=settings.kv_cache_codec,
        sink_tokens=settings.kv_cache_sink_tokens,
        recent_tokens=settings.kv_cache_recent_tokens,
        group_size=settings.kv_cache_quantization_group_size,
        consume=True,  # the entry is the store's now: free each fp16 layer as it goes
    )
    return result.cache if result.quantized else None


@hookimpl(trylast=True)
def kvplugin_dequantize_entry(cache: list, settings: KVPluginSettings) -> list | None:
    from kvplugin.cache import quantize

    return quantize.dequantize_entry(cache, consume=True)  # a fetched entry is the caller's
