"""Default quantize codec: mlx-lm's ``QuantizedKVCache`` at the configured codec, key/value
bits and group (see :mod:`kvplugin.cache.codec.quantize`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from kvplugin.settings import KVPluginSettings


@hookimpl(trylast=True)
def kvplugin_quantize_entry(
    cache: list, num_tokens: int, settings: KVPluginSettings,
    prompt_boundaries: tuple[int, ...] = (), stored_prefix: list | None = None,
    key_ropes: tuple | None = None,
) -> list | None:
    from kvplugin.cache.codec import quantize

    if num_tokens < settings.kv_cache_min_quantize_tokens:
        return None
    from kvplugin.cache.codec.prerope import has_window, window_ropes
    from kvplugin.cache.codec.state import has_state
    from kvplugin.codecs import codec_plan

    plan = codec_plan(settings)
    windowed = has_window(cache)
    result = quantize.quantize_entry(
        cache,
        bits=plan.key_bits,
        value_bits=plan.value_bits,
        codec=plan.codec_for(plain=not windowed and not has_state(cache)),
        sink_tokens=plan.sink_tokens,
        recent_tokens=plan.recent_tokens,
        group_size=plan.group_size,
        prompt_boundaries=prompt_boundaries,
        stored_prefix=stored_prefix,
        quantize_state=plan.quantize_state,
        key_ropes=window_ropes(cache, key_ropes) if plan.prerope_keys else None,
        # as pre-RoPE keys: where an entry has a window (all-plain entries measured fine)
        wide_head_keys=plan.wide_head_keys if windowed else None,
        ranked_key_bits=plan.ranked_key_bits if windowed else None,
        consume=True,  # the entry is the store's now: free each fp16 layer as it goes
    )
    return result.cache if result.quantized else None


@hookimpl(trylast=True)
def kvplugin_dequantize_entry(cache: list, settings: KVPluginSettings,
                              key_ropes: tuple | None = None) -> list | None:
    from kvplugin.cache.codec import quantize

    # a fetched entry is the caller's; keys stored pre-RoPE need the serving model's ropes
    # whatever the settings say now (an entry from a cold tier may predate them)
    return quantize.dequantize_entry(cache, consume=True, key_ropes=key_ropes)
