"""mlx-lm adapter: the seams of ``mlx_lm.server`` and ``mlx_lm.models.cache``.

Installed by the bootstrap right after ``mlx_lm.server`` is imported (the
``mlx_lm.server`` console script and ``python -m mlx_lm server`` both import it).
Everything mlx-lm-specific lives here; every decision (trim, quantize, bound, spill)
is made by :class:`kvplugin.cache.service.service.KVService` and the hooks behind it.

Seams (identical in mlx-lm 0.31.3 and 0.32.x unless noted):

``mlx_lm.server.main``
    Wrapped. While it runs, the first ``ArgumentParser.parse_args`` call (patched on the
    class for that moment only) adds kvplugin's options to the server's parser before
    parsing and resolves the settings after it (a bad value -> ``parser.error``: exit 2
    with a message naming the flag and the env variable).
``mlx_lm.server.run``
    Wrapped. Builds the process's :class:`KVService` from the settings and the host's
    ``--prompt-cache-bytes`` (stock never passes it to its cache) / ``--prompt-cache-size``,
    says one ``kvplugin: active (...)`` line, then calls the original ``run``; when it
    returns (shut-down) the service is closed (``kvplugin_unconfigure``).
``mlx_lm.server.LRUPromptCache``
    Rebound (a by-name copy that ``run`` instantiates) to :class:`KVPluginPromptCache`,
    which keeps the host's interface and is backed by the service's store.
``make_prompt_cache``
    Rebound in ``mlx_lm.models.cache``, ``mlx_lm.server`` and (0.32) ``mlx_lm.generate``:
    the original, then ``service.make_cache`` (``--max-kv-size``, ``--kv-cache-step``).
``BatchKVCache.step`` / ``BatchRotatingKVCache.step``
    The batched path re-merges every cache into these classes, which grow by their class
    ``step``; set to what ``KVService.batch_steps`` decides when the service starts.
``BatchKVCache.merge``
    Replaced by :func:`kvplugin.hosts.mlx_lm_batch.adopting_merge`: a batch of one plain
    ``KVCache`` adopts its arrays instead of copying them (the copy was a whole entry of extra
    memory on every reuse); anything else goes to mlx-lm's own ``merge``.
``mlx_lm.models.cache.PreallocatedRotatingKVCache``
    Added (not replaced), so ``load_prompt_cache`` can read entries saved with kvplugin's
    bounded cache class.
``ModelProvider._load`` / ``ModelProvider.load_default``
    Wrapped: the quantization group size is checked against the loaded model's head
    dimension; at start-up (the default model, loaded by the generation thread) a bad
    value ends the process with exit code 2 and a message naming flag and env variable.
``ResponseGenerator._generate`` / ``ResponseGenerator._next_request``
    Wrapped (:mod:`kvplugin.hosts.mlx_lm_guard`): an exception that escapes the generation
    loop fails the requests in flight and the loop starts again, instead of the thread
    dying and the server answering 503 until restarted.
``APIHandler.do_GET``
    Wrapped: ``GET /kvplugin/stats`` answers the service's counters and the stored
    entries as JSON, ``GET /metrics`` kvplugin's Prometheus series (mlx-lm has no
    ``/metrics`` of its own); every other path goes to the host.
``APIHandler.handle_completion``, ``ResponseGenerator._tokenize`` / ``_serve_single``,
``BatchGenerator.insert_segments`` / ``extract_cache`` / ``next``
    Wrapped (:mod:`kvplugin.hosts.mlx_lm_salt`): a request's ``cache_salt`` reaches the
    prompt cache's calls, which key by it (400 for a bad one).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import threading
from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet

from kvplugin.cache.model.fingerprint import model_fingerprint
from kvplugin.hosts.base import (
    STATS_PATH,
    config_of,
    HostAdapter,
    PatchRegistry,
    SeamError,
    fail_start,
    require,
    wraps_original,
)
from kvplugin.hosts.mlx_lm_salt import UNKNOWN, fetch_salt, insert_salt
from kvplugin.hostspecs import MLX_LM
from kvplugin.log import say

__all__ = ["ADAPTER", "STATS_PATH", "KVPluginPromptCache", "MlxLmAdapter", "SeamError"]

HOST_NAME = MLX_LM.name


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


# --------------------------------------------------------------------------- #
# the prompt cache that replaces mlx_lm.server.LRUPromptCache


class KVPluginPromptCache:
    """mlx-lm's ``LRUPromptCache`` interface over one :class:`KVService`.

    Differences from stock, all deliberate: entries are trimmed to their
    used tokens and maybe quantized before storage; a fetch *moves* the entry to the
    caller (no deepcopy) and returns it dequantized; an exact hit leaves one token to
    process (stock returns no tokens, which both host paths reject); the byte budget
    (``max_bytes``, the host's ``--prompt-cache-bytes``) holds after every insert on
    both paths; evictions spill to the cold tier when there is one. ``cache_type`` is
    accepted and ignored: the store keeps one LRU order.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, service: Any = None):
        self.max_size = max_size
        self.max_bytes = max_bytes
        if service is None:
            service = ADAPTER.take_pending_service()
        if service is None:  # built outside the wrapped ``run`` (a script): own service
            service = ADAPTER.create_service(
                max_bytes=None if max_bytes >= 1 << 62 else max_bytes, max_entries=max_size
            )
        self.service = service

    # -- what mlx_lm.server calls -----------------------------------------------------
    def __len__(self) -> int:
        return len(self.service.store)

    @property
    def nbytes(self) -> int:
        return self.service.store.nbytes

    def _key(self, model: Any, salt: Any) -> str:
        """The store key of a request with ``salt`` (its ``cache_salt``) on ``model``."""
        return self.service.salted_key(self.service.model_key(model_fingerprint(model)), salt)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        salt = fetch_salt()
        if salt is UNKNOWN:  # never served from a namespace that may not be the request's
            say("a prompt-cache fetch could not be matched to its request; served without a "
                "cached prefix", key="mlx-lm:fetch-unknown-salt")
            return None, tokens
        try:
            cache, n = self.service.fetch(self._key(model, salt), tokens,
                                          model=ADAPTER.loaded_model(model))
        except Exception as exc:  # a request must never fail because of the store
            say(f"prompt cache fetch failed ({type(exc).__name__}: {exc}); serving "
                "without a cached prefix", key="mlx-lm:fetch-failed")
            return None, tokens
        if cache is None or n <= 0:
            return None, tokens
        return cache, tokens[n:]

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        salt = insert_salt(prompt_cache)
        if salt is UNKNOWN:  # never stored where another request's salt could find it
            say("a finished cache could not be matched to its request; not stored",
                key="mlx-lm:insert-unknown-salt")
            return
        try:
            self.service.give_back(self._key(model, salt), list(tokens), prompt_cache)
        except Exception as exc:
            say(f"prompt cache insert failed ({type(exc).__name__}: {exc}); entry "
                "dropped", key="mlx-lm:insert-failed")

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        self.service.store.trim_to(n_bytes=n_bytes, n_entries=n_sequences)

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return {"kvplugin": {"n_sequences": len(self), "n_bytes": self.nbytes}}

    # -- kvplugin ----------------------------------------------------------------------
    def report(self) -> dict:
        """The service's report plus the host version (``GET /kvplugin/stats``)."""
        return ADAPTER.report(self.service)


# --------------------------------------------------------------------------- #
# the adapter


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


class MlxLmAdapter(HostAdapter):
    name, distribution, trigger_module = (MLX_LM.name, MLX_LM.distribution,
                                          MLX_LM.trigger_module)
    supported = SpecifierSet(MLX_LM.supported)

    def __init__(self) -> None:
        super().__init__()
        self._state_lock = threading.Lock()
        self.settings: Any = None  # resolved by the wrapped main (or lazily from the env)
        self.namespace: argparse.Namespace | None = None
        self.given_flags: dict[str, Any] = {}
        self.service: Any = None  # the service of the running server
        self._pending: Any = None  # made by the wrapped run, claimed by the prompt cache
        self._provider: Any = None  # the running server's ModelProvider
        self._warned_models: set[int] = set()
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
        wrapped_mpc = self._wrap_make_prompt_cache(original_mpc)
        patches.replace(cache_mod, "make_prompt_cache", wrapped_mpc)
        patches.replace(server, "make_prompt_cache", wrapped_mpc)
        if getattr(gen_mod, "make_prompt_cache", None) is original_mpc:  # 0.32.x copy
            patches.replace(gen_mod, "make_prompt_cache", wrapped_mpc)

        patches.replace(server, "LRUPromptCache", KVPluginPromptCache)
        from kvplugin.hosts.mlx_lm_batch import adopting_merge

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
        patches.replace(server.APIHandler, "do_GET", self._wrap_do_get(server.APIHandler.do_GET))
        from kvplugin.hosts.mlx_lm_guard import guard_generation

        guard_generation(patches, server.ResponseGenerator)
        from kvplugin.hosts.mlx_lm_admission import install_admission

        install_admission(self, server, patches)
        from kvplugin.hosts.mlx_lm_salt import install_salt

        install_salt(self, server, gen_mod, patches)

    def _check_seams(self, server: Any, cache_mod: Any, gen_mod: Any) -> None:
        """Fail closed: every seam present, with the signature this adapter was written for."""
        for name in ("main", "run", "LRUPromptCache", "make_prompt_cache", "ModelProvider",
                     "APIHandler", "ResponseGenerator"):
            require(hasattr(server, name), f"mlx_lm.server.{name} is missing")
        from kvplugin.hosts.mlx_lm_admission import check_admission_seams

        check_admission_seams(server)
        from kvplugin.hosts.mlx_lm_salt import check_salt_seams

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
        self._apply_batch_steps(service)
        self.say_active(service)
        self._say_bounded_batches(settings)
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

    def _apply_batch_steps(self, service: Any) -> None:
        """Set the batch caches' class ``step`` to what the session decided (once)."""
        with self._state_lock:
            if self._step_patched:
                return
            self._step_patched = True
        for cls, step in service.batch_steps().items():
            self.registry.replace(getattr(self._cache_mod, cls), "step", step)

    def _say_bounded_batches(self, s: Any) -> None:
        """How mlx-lm's own batched path bounds (it is mlx-lm's class, not kvplugin's)."""
        if s.max_kv_size is not None:
            say(
                f"--max-kv-size {s.max_kv_size}: every request gets a rotating cache of at "
                f"most {s.max_kv_size} tokens that keeps the first 4 (as mlx-lm's "
                f"generate --max-kv-size does), on both of mlx-lm's paths: batched requests "
                f"run in kvplugin's KeepingBatchRotatingKVCache, which keeps each row's first "
                f"4 (mlx-lm's own BatchRotatingKVCache keeps none and would answer "
                f"differently)",
                key="mlx-lm:max-kv-batched",
            )
            say(
                f"--max-kv-size {s.max_kv_size}: once a conversation passes {s.max_kv_size} "
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
            if bits is not None:  # the host quantizes its live caches: hand matching layers back
                service.live_quantization = (int(bits), int(getattr(cli, "kv_group_size", 64)),
                                             int(getattr(cli, "quantized_kv_start", 0) or 0))
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

    def _wrap_make_prompt_cache(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def make_prompt_cache(model, *args: Any, **kwargs: Any) -> list:
            cache = original(model, *args, **kwargs)
            service = adapter.service
            if service is None:  # no kvplugin server in this process: stock behaviour
                return cache
            try:
                shaped = service.make_cache(model, cache)
            except Exception as exc:
                say(f"could not shape a new cache ({type(exc).__name__}: {exc}); using "
                    "mlx-lm's", key="mlx-lm:make-cache-failed")
                return cache
            adapter._warn_unbounded(model, shaped, service.settings)
            return shaped

        return make_prompt_cache

    def _warn_unbounded(self, model: Any, cache: list, settings: Any) -> None:
        """Once per model: which layers ``--max-kv-size`` / ``--kv-cache-step`` cannot reach."""
        if id(model) in self._warned_models:
            return
        self._warned_models.add(id(model))
        cm = self._cache_mod
        n = settings.max_kv_size
        if n is not None:
            loose: dict[str, int] = {}
            for layer in cache:
                if isinstance(layer, cm.RotatingKVCache) and layer.max_size <= n:
                    continue
                if isinstance(layer, getattr(cm, "ArraysCache", ())):
                    continue  # fixed-size recurrent state
                loose[type(layer).__name__] = loose.get(type(layer).__name__, 0) + 1
            if loose:
                kinds = ", ".join(f"{k} x{v}" for k, v in sorted(loose.items()))
                say(
                    f"--max-kv-size {n}: {len(cache) - sum(loose.values())} of {len(cache)} "
                    f"cache layers of {type(model).__module__} are bounded; {kinds} are not "
                    f"plain KV caches and still grow with the context",
                    key=f"mlx-lm:unbounded:{id(model)}",
                )
        elif settings.kv_cache_step is not None:
            other = sorted({type(layer).__name__ for layer in cache
                            if type(layer) not in (cm.KVCache, cm.QuantizedKVCache)})
            if other:
                say(
                    f"--kv-cache-step {settings.kv_cache_step} applies to KVCache layers only; "
                    f"{', '.join(other)} layers of {type(model).__module__} keep mlx-lm's "
                    f"growth", key=f"mlx-lm:step:{id(model)}",
                )

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

    def _wrap_do_get(self, original: Callable) -> Callable:
        from kvplugin.metrics import CONTENT_TYPE, METRICS_PATH

        @wraps_original(original)
        def do_GET(handler, *args: Any, **kwargs: Any) -> Any:
            path = handler.path.split("?", 1)[0].rstrip("/")
            if path not in (STATS_PATH, METRICS_PATH):
                return original(handler, *args, **kwargs)
            generator = getattr(handler, "response_generator", None)
            cache = getattr(generator, "prompt_cache", None)
            if not isinstance(cache, KVPluginPromptCache):
                return original(handler, *args, **kwargs)
            try:
                if path == METRICS_PATH:  # mlx-lm has no /metrics: kvplugin's series only
                    from kvplugin.metrics import exposition

                    status, data, kind = 200, exposition(cache.service.stats()), CONTENT_TYPE
                else:
                    body = cache.report()
                    status, kind = 200, "application/json"
                    data = json.dumps(body, default=str).encode()
            except Exception as exc:
                status, kind = 500, "application/json"
                data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            handler.send_response(status)
            handler.send_header("Content-type", kind)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
            handler.wfile.flush()

        return do_GET

    # -- uninstall ---------------------------------------------------------------------------
    def uninstall(self) -> None:
        super().uninstall()
        with self._state_lock:
            self.service = None
            self._pending = None
            self._step_patched = False
            self._warned_models.clear()


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
