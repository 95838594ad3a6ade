"""The mlx-lm adapter: every seam checked, then patched through one registry (all or none);
the server's options (``main``), start-up (``run``, the model load) and the per-request cache
(``make_prompt_cache``). The seams are listed in :mod:`kvplugin.hosts.mlx_lm`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import (
    HostAdapter,
    PatchRegistry,
    config_of,
    fail_start,
    require,
    shaping_make_prompt_cache,
    wraps_original,
)
from kvplugin.hostspecs import MLX_LM
from kvplugin.log import say

__all__ = ["ADAPTER", "MlxLmAdapter", "on_import"]


KV_BITS_NOTE = (
    "How these relate to mlx-lm's --kv-bits: --kv-bits quantizes the LIVE cache of every "
    "request while it is generated (and sends requests down mlx-lm's sequential path); "
    "--kv-cache-quantization* quantize only the prompt-cache entries kvplugin STORES between "
    "requests. Both can be used together (entries mlx-lm already quantized are stored as they "
    "are). --max-kv-size cannot be combined with --kv-bits (mlx-lm cannot quantize a bounded "
    "cache) or --draft-model; the server refuses to start and says why."
)


class _StartupError(ValueError):
    """A configuration error found while the default model loads at start-up."""


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


class MlxLmAdapter(HostAdapter, declaration=MLX_LM):
    """``mlx_lm.server`` backed by kvplugin's engine (:data:`~kvplugin.hostspecs.MLX_LM`)."""

    def __init__(self) -> None:
        super().__init__()
        self._state_lock = threading.Lock()
        self.settings: Any = None  # resolved by the wrapped main (or lazily from the env)
        self.namespace: argparse.Namespace | None = None
        self.given_flags: dict[str, Any] = {}
        self.service: Any = None  # the service of the running server
        self._pending: Any = None  # made by the wrapped run, claimed by the prompt cache
        self._provider: Any = None  # the running server's ModelProvider
        self._step_patched = False

    # -- install -----------------------------------------------------------------------
    def apply(self, module: Any, patches: PatchRegistry) -> None:
        server = module
        cache_mod = importlib.import_module("mlx_lm.models.cache")
        gen_mod = importlib.import_module("mlx_lm.generate")  # the module, not the function
        self._check_seams(server, cache_mod, gen_mod)
        self._server, self._cache_mod = server, cache_mod

        original_mpc = cache_mod.make_prompt_cache
        self._original_mpc = original_mpc
        wrapped_mpc = shaping_make_prompt_cache(self, original_mpc, "mlx-lm:make-cache-failed")
        patches.replace(cache_mod, "make_prompt_cache", wrapped_mpc)
        patches.replace(server, "make_prompt_cache", wrapped_mpc)
        if getattr(gen_mod, "make_prompt_cache", None) is original_mpc:  # 0.32.x copy
            patches.replace(gen_mod, "make_prompt_cache", wrapped_mpc)

        from kvplugin.hosts.mlx_lm.prompt_cache import KVPluginPromptCache

        KVPluginPromptCache.adapter = self
        patches.replace(server, "LRUPromptCache", KVPluginPromptCache)
        from kvplugin.hosts.mlx_lm.batch import adopting_merge

        batch_cls = cache_mod.BatchKVCache
        patches.replace(batch_cls, "merge",
                        adopting_merge(vars(batch_cls)["merge"].__func__, cache_mod.KVCache))
        from kvplugin.cache.bounded.prealloc import register_with_mlx_lm

        register_with_mlx_lm(patches)
        patches.replace(server, "main", self._wrap_main(server.main))
        patches.replace(server, "run", self._wrap_run(server.run))

        provider = server.ModelProvider
        patches.replace(provider, "_load", self._wrap_load(provider._load))
        patches.replace(provider, "load_default", self._wrap_load_default(provider.load_default))
        from kvplugin.hosts.mlx_lm.routes import install_routes

        install_routes(patches, server.APIHandler)
        from kvplugin.hosts.mlx_lm.guard import guard_generation

        guard_generation(patches, server.ResponseGenerator)
        from kvplugin.hosts.mlx_lm.admission import install_admission

        install_admission(self, server, patches)
        from kvplugin.hosts.mlx_lm.salt import install_salt

        install_salt(self, server, gen_mod, patches)

    def _check_seams(self, server: Any, cache_mod: Any, gen_mod: Any) -> None:
        """Fail closed: every seam present, with the signature this adapter was written for."""
        for name in ("main", "run", "LRUPromptCache", "make_prompt_cache", "ModelProvider",
                     "APIHandler", "ResponseGenerator"):
            require(hasattr(server, name), f"mlx_lm.server.{name} is missing")
        from kvplugin.hosts.mlx_lm.admission import check_admission_seams

        check_admission_seams(server)
        from kvplugin.hosts.mlx_lm.salt import check_salt_seams

        check_salt_seams(server, gen_mod)
        mpc = cache_mod.make_prompt_cache
        require(server.make_prompt_cache is mpc,
                 "mlx_lm.server.make_prompt_cache is not mlx_lm.models.cache's")
        gen_mpc = getattr(gen_mod, "make_prompt_cache", mpc)
        require(gen_mpc is mpc, "mlx_lm.generate.make_prompt_cache is not mlx_lm.models.cache's")
        require(_params(mpc)[:2] == ["model", "max_kv_size"],
                 f"make_prompt_cache{inspect.signature(mpc)}")
        require(_params(server.run)[:3] == ["host", "port", "model_provider"],
                 f"run{inspect.signature(server.run)}")
        require(_params(server.main) == [], f"main{inspect.signature(server.main)}")
        lru = server.LRUPromptCache
        stock = lru is getattr(cache_mod, "LRUPromptCache", None)
        require(stock or lru.__name__ == "LRUPromptCache",
                 "mlx_lm.server.LRUPromptCache is not mlx-lm's")
        require(_params(lru.fetch_nearest_cache)[:3] == ["self", "model", "tokens"],
                 "LRUPromptCache.fetch_nearest_cache")
        ins = inspect.signature(lru.insert_cache).parameters
        require(list(ins)[:4] == ["self", "model", "tokens", "prompt_cache"]
                 and "cache_type" in ins, "LRUPromptCache.insert_cache")
        trim = inspect.signature(lru.trim_to).parameters
        require("n_sequences" in trim and "n_bytes" in trim, "LRUPromptCache.trim_to")
        provider = server.ModelProvider
        require(_params(provider._load)[:4] == ["self", "model_path", "adapter_path",
                                                 "draft_model_path"], "ModelProvider._load")
        require(_params(provider.load_default) == ["self"], "ModelProvider.load_default")
        require(callable(getattr(server.APIHandler, "do_GET", None)), "APIHandler.do_GET")
        for name in ("_generate", "_next_request"):
            require(callable(getattr(server.ResponseGenerator, name, None)),
                    f"ResponseGenerator.{name}")
        for cls in ("BatchKVCache", "BatchRotatingKVCache", "KVCache", "RotatingKVCache"):
            require(isinstance(getattr(getattr(cache_mod, cls, None), "step", None), int),
                     f"mlx_lm.models.cache.{cls}.step")

    # -- settings and service ----------------------------------------------------------
    def ensure_settings(self) -> Any:
        """The resolved settings: from the wrapped main, else from the environment."""
        with self._state_lock:
            if self.settings is None:
                from kvplugin.settings import resolve_settings

                self.settings = resolve_settings()
            return self.settings

    def create_service(self, *, max_bytes: int | None, max_entries: int | None) -> Any:
        settings = self.ensure_settings()
        service = self.make_session(settings, max_bytes=max_bytes, max_entries=max_entries)
        with self._state_lock:
            self.service = service
        plan = service.batch_plan()
        self._apply_batch_steps(plan.steps)
        self.say_active(service)
        self._say_bounded_batches(plan.bound)
        return service

    def loaded_model(self, key: Any) -> Any:
        """The ``nn.Module`` the server runs for ``key`` (mlx-lm passes its model key to the
        prompt cache, not the model), so a fetched entry can be checked against it."""
        provider = self._provider
        if provider is None:
            return key if hasattr(key, "layers") else None
        if getattr(provider, "model_key", None) == key or key is getattr(provider, "model", 0):
            return getattr(provider, "model", None)
        return None

    def take_pending_service(self) -> Any:
        with self._state_lock:
            service, self._pending = self._pending, None
            return service

    def _apply_batch_steps(self, steps: dict[str, int]) -> None:
        """Set the batch caches' class ``step`` to what the service decided (once)."""
        with self._state_lock:
            if self._step_patched:
                return
            self._step_patched = True
        for cls, step in steps.items():
            self.registry.replace(getattr(self._cache_mod, cls), "step", step)

    def _say_bounded_batches(self, bound: int | None) -> None:
        """What a bound means on mlx-lm's two paths (the service decided the bound)."""
        if bound is not None:
            say(
                f"--max-kv-size {bound}: every request gets a rotating cache of at "
                f"most {bound} tokens that keeps the first 4 (as mlx-lm's "
                f"generate --max-kv-size does), on both of mlx-lm's paths: batched requests "
                f"run in kvplugin's KeepingBatchRotatingKVCache, which keeps each row's first "
                f"4 (mlx-lm's own BatchRotatingKVCache keeps none and would answer "
                f"differently)",
                key="mlx-lm:max-kv-batched",
            )
            say(
                f"--max-kv-size {bound}: once a conversation passes {bound} "
                f"tokens its bounded layers have wrapped and cannot be cut back, so its next "
                f"turn reuses the stored entry only if the new prompt repeats the stored tokens "
                f"(prompt and reply) one for one; a reply the chat template re-tokenizes "
                f"differently is a miss (layers that stay unbounded, such as chunked ones, could "
                f"be cut, but a stored entry is reused whole or not at all)",
                key="mlx-lm:max-kv-continue",
            )

    # -- wrappers --------------------------------------------------------------------------
    def _wrap_main(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def main(*args: Any, **kwargs: Any) -> Any:
            cls = argparse.ArgumentParser
            raw = vars(cls)["parse_args"]
            done = False

            @wraps_original(raw)
            def parse_args(parser, args=None, namespace=None):
                nonlocal done
                if done:
                    return raw(parser, args, namespace)
                done = True
                if vars(cls).get("parse_args") is parse_args:
                    cls.parse_args = raw  # only the first call is ours
                return adapter._parse(parser, raw, args, namespace)

            cls.parse_args = parse_args
            try:
                return original(*args, **kwargs)
            finally:
                if vars(cls).get("parse_args") is parse_args:
                    cls.parse_args = raw

        return main

    def _parse(self, parser: argparse.ArgumentParser, raw: Callable, args: Any,
               namespace: Any) -> argparse.Namespace:
        from kvplugin.options import add_options, given_flags, settings_from_namespace
        from kvplugin.settings import SettingsError

        add_options(parser, description=KV_BITS_NOTE)
        ns = raw(parser, args, namespace)
        given = given_flags(parser, ns)  # before settings_from_namespace fills in the rest
        try:
            settings = settings_from_namespace(parser, ns)
        except SettingsError as err:
            parser.error(str(err))
        from kvplugin.cache.service.startup_checks import host_option_conflict

        conflict = host_option_conflict(settings, {
            "kv_bits": getattr(ns, "kv_bits", None),
            "draft_model": getattr(ns, "draft_model", None),
        })
        if conflict is not None:
            parser.error(conflict)
        with self._state_lock:
            self.settings = settings
            self.namespace = ns
            self.given_flags = given
        return ns

    def _wrap_run(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def run(host, port, model_provider, *args: Any, **kwargs: Any) -> Any:
            from kvplugin.settings import SettingsError

            cli = getattr(model_provider, "cli_args", None)
            max_bytes = getattr(cli, "prompt_cache_bytes", None)
            max_entries = getattr(cli, "prompt_cache_size", None)
            # Decide what the model's config can tell before the server listens: the
            # weights load later, in the generation thread, after "Starting httpd".
            config = config_of(getattr(cli, "model", None))
            if config is not None:
                problem = adapter.model_problem({"args": config}, adapter.settings,
                                                adapter.given_flags)
                if problem is not None:
                    fail_start(problem)
            try:
                service = adapter.create_service(max_bytes=max_bytes, max_entries=max_entries)
            except SettingsError as err:  # any failure to build it (HostAdapter.make_session)
                fail_start(str(err))
            bits = getattr(cli, "kv_bits", None)
            if bits is not None:  # mlx-lm's --kv-bits: its live caches are quantized
                service.learn_live_quantization(bits, getattr(cli, "kv_group_size", 64),
                                                getattr(cli, "quantized_kv_start", 0) or 0)
            with adapter._state_lock:
                adapter._pending = service
                adapter._provider = model_provider
            try:
                return original(host, port, model_provider, *args, **kwargs)
            finally:
                with adapter._state_lock:
                    adapter._pending = None
                    adapter._provider = None
                service.close()  # shut-down: store closed, then kvplugin_unconfigure

        return run

    def _wrap_load(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def _load(provider, *args: Any, **kwargs: Any) -> Any:
            result = original(provider, *args, **kwargs)
            problem = adapter._group_size_problem(provider.model)
            if problem is not None:
                _unload(provider)
                raise _StartupError(problem)
            adapter._learn_model(provider.model)
            return result

        return _load

    def _wrap_load_default(self, original: Callable) -> Callable:
        @wraps_original(original)
        def load_default(provider, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(provider, *args, **kwargs)
            except _StartupError as err:
                # The default model loads in the generation thread right at start-up:
                # the server must not keep running with a configuration it cannot honour.
                fail_start(str(err))

        return load_default

    def _learn_model(self, model: Any) -> None:
        """Admission control learns the model's memory per token (in the generation thread,
        which runs the model), from a fresh cache shaped as a request's would be."""
        if self.service is not None:
            # mlx-lm loads the model in its generation thread, which then serves
            self.service.learn_model(model, self._original_mpc(model), serving_thread=True)

    def _group_size_problem(self, model: Any) -> str | None:
        return self.model_problem(model, self.settings, self.given_flags)

    # -- uninstall ---------------------------------------------------------------------------
    def uninstall(self) -> None:
        super().uninstall()
        with self._state_lock:
            self.service = None
            self._pending = None
            self._step_patched = False


def _unload(provider: Any) -> None:
    """Forget the loaded model (``ModelProvider.reset`` exists from 0.32 only)."""
    reset = getattr(provider, "reset", None)
    if callable(reset):
        reset()
        return
    for name in ("model_key", "model", "tokenizer", "draft_model"):
        setattr(provider, name, None)


ADAPTER = MlxLmAdapter()


def on_import(module: Any) -> None:
    ADAPTER.install(module)
