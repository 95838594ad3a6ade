"""Default (simple) mode: ``SimpleEngine``'s generations get their cache from kvplugin.

Every pure-LLM generation of ``SimpleEngine`` ends in mlx-lm's ``stream_generate``
(``MLXLanguageModel.stream_generate``/``generate``). kvplugin wraps ``mlx_lm.stream_generate``
and ``mlx_lm.generate.stream_generate`` for the engine's model only: the cache of each
request comes from the session (a stored prefix of the request is moved, not copied; a
prefix shared with another conversation's entry is copied; restored to full precision) or
is made by ``KVService.make_cache`` (``--max-kv-size``, ``--kv-cache-step``); after the
request the cache (prompt + output) is handed back to the session, which trims, quantizes
and budgets it. The host's own partial caches of that path (the system-prefix snapshot LRU,
which ignores every flag, and the opt-in ``--prefix-trie-cache``) are switched off.

Nothing here imports vllm-mlx or mlx at import time; the wrappers read the adapter's
:class:`~kvplugin.hosts.vllm_mlx.runtime.Runtime` at call time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from kvplugin.hosts.base import PatchRegistry, require_attrs, wraps_original
from kvplugin.hosts.vllm_mlx.admission import admit_or_raise
from kvplugin.hosts.vllm_mlx.salt import request_salt
from kvplugin.log import say

#: A caller-made cache, embeddings, live quantization or speculative decoding: stock path.
BYPASS_KWARGS = ("prompt_cache", "input_embeddings", "kv_bits", "num_draft_tokens")


def check_seams(mlx_lm: Any, gen_mod: Any, simple: Any) -> None:
    """Fail closed: every seam of this mode present, with the expected shape."""
    require_attrs(gen_mod, "stream_generate")
    require_attrs(mlx_lm, "stream_generate")
    require_attrs(simple, "SimpleEngine", "build_system_prompt_cache_prefix")
    require_attrs(simple.SimpleEngine, "__init__", "start", "stop")
    params = inspect.signature(simple.SimpleEngine.__init__).parameters
    if "max_kv_size" not in params:
        raise TypeError("SimpleEngine.__init__ has no max_kv_size (vllm-mlx < 0.3?)")
    if not inspect.iscoroutinefunction(simple.SimpleEngine.start):
        raise TypeError("SimpleEngine.start is not a coroutine")
    sg = inspect.signature(gen_mod.stream_generate).parameters
    if list(sg)[:3] != ["model", "tokenizer", "prompt"]:
        raise TypeError("mlx_lm.stream_generate(model, tokenizer, prompt, ...) changed")


def install(patches: PatchRegistry, adapter: Any, mlx_lm: Any, gen_mod: Any, simple: Any) -> None:
    """Patch this mode's seams (after :func:`check_seams`)."""
    wrapped = wrap_stream_generate(gen_mod.stream_generate, adapter)
    patches.replace(gen_mod, "stream_generate", wrapped)
    if mlx_lm.stream_generate is not wrapped:
        patches.replace(mlx_lm, "stream_generate", wrapped)

    @wraps_original(simple.build_system_prompt_cache_prefix)
    def build_system_prompt_cache_prefix(*args: Any, **kwargs: Any) -> None:
        return no_system_prefix_snapshot(*args, **kwargs)

    patches.replace(simple, "build_system_prompt_cache_prefix", build_system_prompt_cache_prefix)
    se = simple.SimpleEngine
    patches.replace(se, "__init__", wrap_init(se.__init__))
    patches.replace(se, "start", wrap_start(se.start, adapter))
    patches.replace(se, "stop", wrap_stop(se.stop, adapter))


def say_mllm() -> None:
    """One notice: a multimodal model's cache is vllm-mlx's own, not kvplugin's."""
    say(
        "multimodal model: vllm-mlx's MLLM prompt cache is not kvplugin's, so kvplugin's "
        "store, quantization, --max-kv-size and --hot-cache-only are not applied to it",
        key="vllm-mlx:mllm",
    )


def no_system_prefix_snapshot(*args: Any, **kwargs: Any) -> None:
    """Replaces ``engine.simple.build_system_prompt_cache_prefix``: no system-prefix snapshot.

    That LRU (``VLLM_MLX_SYSTEM_KV_SLOTS``) copies snapshots and ignores every cache flag; with
    kvplugin the request goes down the plain path, whose cache is kvplugin's store.
    """
    return None


def wrap_init(original: Callable) -> Callable:
    @wraps_original(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "_is_mllm", False):
            say_mllm()
            return
        # kvplugin's store takes the role of the optional mlx-lm trie cache
        self._prefix_trie_cache_enabled = False

    return __init__


def engine_model(engine: Any) -> Any:
    """The ``nn.Module`` a ``SimpleEngine`` generates with (its wrapper's ``model``)."""
    return getattr(getattr(engine, "_model", None), "model", None)


def wrap_start(original: Callable, adapter: Any) -> Callable:
    """After the engine loaded its model: check it, and register it so its generations are
    served from the store under its key."""

    @wraps_original(original)
    async def start(self, *args, **kwargs):
        result = await original(self, *args, **kwargs)
        rt = adapter.runtime
        if not getattr(self, "_is_mllm", False) and rt.service is not None:
            model = engine_model(self)
            if model is not None:
                adapter.check_model(model, hard=True)
                with rt.lock:
                    rt.simple_models[id(model)] = rt.model_key(model)
                from mlx_lm.models.cache import make_prompt_cache

                rt.service.learn_model(model, make_prompt_cache(model))
        return result

    return start


def wrap_stop(original: Callable, adapter: Any) -> Callable:
    """After the engine stopped: forget its model; an explicit ``--ssd-cache-dir`` keeps the
    hot entries across a restart (the session decides what that means)."""

    @wraps_original(original)
    async def stop(self, *args, **kwargs):
        model = engine_model(self)
        try:
            return await original(self, *args, **kwargs)
        finally:
            if model is not None:
                rt = adapter.runtime
                with rt.lock:
                    registered = rt.simple_models.pop(id(model), None)
                if registered is not None and rt.service is not None:
                    rt.service.flush_configured()

    return stop


def tokens_of(tokenizer: Any, prompt: Any) -> list[int]:
    """The prompt tokens exactly as ``mlx_lm.stream_generate`` computes them."""
    import mlx.core as mx

    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    return [int(t) for t in prompt]


def wrap_stream_generate(original: Callable, adapter: Any) -> Callable:
    """``mlx_lm.stream_generate`` whose cache comes from / goes back to kvplugin's store.

    Engages only for models a kvplugin-managed ``SimpleEngine`` registered, and only for a
    plain call (no draft model, no caller-made cache, no embeddings, no live quantization).
    With logits processors the prefix is not reused (they would only see the uncached tail
    of the context) but the result is still stored.
    """

    @wraps_original(original)
    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
        rt = adapter.runtime
        key = rt.simple_models.get(id(model))
        service = rt.service
        if (
            key is None
            or service is None
            or draft_model is not None
            or any(kwargs.get(k) is not None for k in BYPASS_KWARGS)
        ):
            yield from original(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)
            return
        yield from cached_generation(
            original, service, key, model, tokenizer, prompt, max_tokens, kwargs
        )

    return stream_generate


def cached_generation(original: Callable, service: Any, key: str, model: Any, tokenizer: Any,
                      prompt: Any, max_tokens: int, kwargs: dict) -> Iterator[Any]:
    """One generation on a cache from the session; the cache goes back when it ends (also
    when the consumer stops early), never when the generation failed."""
    import dataclasses

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    tokens = tokens_of(tokenizer, prompt)
    key = service.salted_key(key, request_salt())  # the request's cache_salt, if any
    ticket = object()  # this generation's reservation under --max-memory
    admit_or_raise(service, id(ticket), model, prompt_tokens=len(tokens), max_tokens=max_tokens,
                   prefill_chunk=int(kwargs.get("prefill_step_size") or 2048))
    cache, n = None, 0
    if len(tokens) >= 2 and not kwargs.get("logits_processors"):
        cache, n = service.fetch(key, tokens, model=model)
    if cache is None:
        fresh = make_prompt_cache(model, max_kv_size=kwargs.get("max_kv_size"))
        cache, n = service.make_cache(model, fresh), 0
    kwargs.pop("max_kv_size", None)
    kwargs.pop("prompt_cache", None)
    generated: list[int] = []
    ok = False
    try:
        for resp in original(
            model, tokenizer, mx.array(tokens[n:]), max_tokens, None, prompt_cache=cache, **kwargs
        ):
            token = getattr(resp, "token", None)
            if token is not None:
                generated.append(int(token))
            if n and dataclasses.is_dataclass(resp) and hasattr(resp, "prompt_tokens"):
                resp = dataclasses.replace(resp, prompt_tokens=len(tokens))
            yield resp
        ok = True
    except GeneratorExit:  # the consumer stopped early (max tokens, stop string, abort)
        ok = True
        raise
    finally:
        if ok:
            give_back(service, key, tokens + generated, cache)
        service.request_done(id(ticket))


def give_back(service: Any, key: str, sequence: list[int], cache: list) -> None:
    """Hand a finished request's cache to the store (keyed by exactly what it holds)."""
    try:
        service.give_back(key, sequence, cache, min_tokens=2)
    except Exception as exc:  # never fail a finished request because of the store
        say(f"storing a prompt cache failed ({type(exc).__name__}: {exc})", key="store-failed")
