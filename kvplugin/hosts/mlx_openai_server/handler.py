"""The model process's seams: its prompt cache, cache construction, mlx-lm's batch caches,
admission and requests' ``cache_salt`` in front of both generation paths, and the report
methods the server calls.

Why patched when the first language-model handler is built, not at import: the server
process imports ``app.server`` too but never mlx; these modules (and mlx) are imported only
where a model runs. Translate, never decide: every decision is the service's.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import (PatchRegistry, require, require_attrs, shaping_make_prompt_cache,
                                 wraps_original)

__all__ = ["install_child"]

_HANDLER_METHODS = ("__init__", "_build_inference_context", "generate_text_response",
                    "generate_text_stream", "_is_request_batchable")


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def check_child_seams(pc_mod: Any, model_mod: Any, handler_mod: Any, cache_mod: Any) -> None:
    """Fail closed: every seam present, with the shape this adapter was written for."""
    lru = getattr(pc_mod, "LRUPromptCache", None)
    require(lru is not None, "app.utils.prompt_cache.LRUPromptCache is missing")
    require(_params(lru.__init__)[:4] == ["self", "max_size", "max_bytes", "cache_dir"],
            "LRUPromptCache(max_size, max_bytes, cache_dir)")
    fetch = inspect.signature(lru.fetch_nearest_cache).parameters
    require(list(fetch)[:2] == ["self", "tokens_ids"] and "allowed_sources" in fetch,
            "LRUPromptCache.fetch_nearest_cache(tokens_ids, *, allowed_sources)")
    ins = inspect.signature(lru.insert_cache).parameters
    require(list(ins)[:3] == ["self", "tokens_ids", "prompt_cache"] and "source" in ins
            and "cache_type" in ins, "LRUPromptCache.insert_cache")
    trim = inspect.signature(lru.trim_to).parameters
    require("n_sequences" in trim and "n_bytes" in trim, "LRUPromptCache.trim_to")
    mpc = cache_mod.make_prompt_cache
    require(getattr(model_mod, "make_prompt_cache", None) is mpc,
            "app.models.mlx_lm.make_prompt_cache is not mlx-lm's")
    require(_params(mpc)[:2] == ["model", "max_kv_size"], "make_prompt_cache(model, max_kv_size)")
    require_attrs(handler_mod, "MLXLMHandler")
    require_attrs(handler_mod.MLXLMHandler, *_HANDLER_METHODS)
    for name in ("kvplugin_report", "kvplugin_stats"):
        require(not hasattr(handler_mod.MLXLMHandler, name), f"MLXLMHandler.{name} exists")
    require_attrs(cache_mod.BatchKVCache, "merge", "filter", "extract")
    for cls in ("BatchKVCache", "BatchRotatingKVCache"):
        require(isinstance(getattr(getattr(cache_mod, cls, None), "step", None), int),
                f"mlx_lm.models.cache.{cls}.step")


def install_child(adapter: Any, patches: PatchRegistry) -> None:
    """Check, then patch, the model process's seams through ``patches``."""
    pc_mod = importlib.import_module("app.utils.prompt_cache")
    model_mod = importlib.import_module("app.models.mlx_lm")
    handler_mod = importlib.import_module("app.handler.mlx_lm")
    cache_mod = importlib.import_module("mlx_lm.models.cache")
    sched_mod = importlib.import_module("app.core.batch_scheduler")
    gen_mod = importlib.import_module("mlx_lm.generate")
    check_child_seams(pc_mod, model_mod, handler_mod, cache_mod)
    from kvplugin.hosts.mlx_openai_server.salt import check_salt_seams, install_salt

    check_salt_seams(sched_mod, gen_mod)
    adapter._cache_mod = cache_mod

    from kvplugin.hosts.mlx_openai_server.prompt_cache import KVPluginOaiPromptCache

    KVPluginOaiPromptCache.adapter = adapter
    patches.replace(pc_mod, "LRUPromptCache", KVPluginOaiPromptCache)

    original_mpc = cache_mod.make_prompt_cache
    wrapped_mpc = _wrap_make_prompt_cache(adapter, original_mpc)
    patches.replace(cache_mod, "make_prompt_cache", wrapped_mpc)  # BatchGenerator's
    patches.replace(model_mod, "make_prompt_cache", wrapped_mpc)  # the single-request path's

    from kvplugin.hosts.mlx_lm.batch import adopting_extract, adopting_merge, whole_batch_filter

    batch, own = cache_mod.BatchKVCache, vars(cache_mod.BatchKVCache)
    patches.replace(batch, "merge", adopting_merge(own["merge"].__func__, cache_mod.KVCache))
    patches.replace(batch, "filter", whole_batch_filter(own["filter"]))
    patches.replace(batch, "extract", adopting_extract(own["extract"], cache_mod.KVCache))

    cls = handler_mod.MLXLMHandler
    patches.replace(cls, "__init__", _wrap_init(adapter, cls.__init__, original_mpc))
    from kvplugin.hosts.mlx_openai_server.admission import install_admission

    refusals = install_admission(adapter, cls, patches)
    install_salt(adapter, cls, sched_mod, gen_mod, refusals, patches)  # checked before admission
    patches.add(cls, "kvplugin_report", _report)
    patches.add(cls, "kvplugin_stats", _stats)


def _wrap_make_prompt_cache(adapter: Any, original: Callable) -> Callable:
    from kvplugin.hosts.mlx_openai_server.salt import fetch_salt, tag_cache

    shaped = shaping_make_prompt_cache(adapter, original, "oai:make-cache-failed")

    @wraps_original(original)
    def make_prompt_cache(model: Any, *args: Any, **kwargs: Any) -> list:
        cache = shaped(model, *args, **kwargs)
        if adapter.service is not None:  # the single-request path inserts on another thread
            tag_cache(cache, fetch_salt())
        return cache

    return make_prompt_cache


def _wrap_init(adapter: Any, original: Callable, original_mpc: Callable) -> Callable:
    @wraps_original(original)
    def __init__(handler: Any, *args: Any, **kwargs: Any) -> None:
        original(handler, *args, **kwargs)
        cache, service = getattr(handler, "prompt_cache", None), adapter.service
        if service is None or not hasattr(cache, "bind"):
            return
        wrapper = handler.model
        model = wrapper.model
        # a draft model's layers follow the model's in every cache: no per-model check then
        cache.bind(model, checked=not getattr(wrapper, "has_draft_model", False))
        bits = getattr(handler, "kv_bits", None)
        if bits is not None:  # the host's --kv-bits: its live caches are quantized
            service.learn_live_quantization(bits, getattr(handler, "kv_group_size", 64),
                                            getattr(handler, "quantized_kv_start", 0) or 0)
        service.learn_model(model, original_mpc(model))

    return __init__


async def _report(handler: Any) -> dict:
    """``GET /kvplugin/stats`` of this model (the server asks through its proxy)."""
    return handler.prompt_cache.report()


async def _stats(handler: Any) -> dict:
    """The counters ``GET /metrics`` exposes for this model."""
    return handler.prompt_cache.service.stats()
