"""vllm-mlx adapter: ``vllm-mlx serve`` backed by kvplugin's engine in every mode.

What is patched, in two stages (each all-or-nothing; seams are checked before anything is
replaced, and every replacement goes through the :class:`PatchRegistry`):

**Stage 1, on ``import vllm_mlx.cli``** (cheap: nothing heavy is imported):

* ``cli.create_parser`` (and its import-time alias ``build_parser``): the serve subparser
  gets kvplugin's options. vllm-mlx's own ``--kv-cache-quantization*``,
  ``--kv-cache-min-quantize-tokens``, ``--max-kv-size``, ``--ssd-cache-dir`` and
  ``--ssd-cache-max-gb`` are *adopted* (same spelling, ``choices`` dropped so bits 2-8 pass,
  kvplugin validates); ``--hot-cache-only`` and ``--kv-cache-step`` are added. Every help
  text names its ``KVPLUGIN_*`` variable.
* ``cli.serve_command``: resolves the settings (flag > env > default) and writes them back
  into the namespace, so host code sees the same values. A bad value exits with status 2
  and a message naming the flag and the variable, before anything is loaded. Then stage 2.

**Stage 2, inside ``serve_command``** (the host imports ``vllm_mlx.server`` there anyway):

* Group size vs the model's head dimension, from the model's ``config.json`` as soon as the
  model path is known (before the weights load); later, from the loaded model, if the path
  could not be resolved early. A mismatch stops the server (status 2, one message).
* Default (simple) mode: every pure-LLM generation of ``SimpleEngine`` ends in mlx-lm's
  ``stream_generate`` (``MLXLanguageModel.stream_generate``/``generate``). kvplugin wraps
  ``mlx_lm.stream_generate`` and ``mlx_lm.generate.stream_generate`` for the engine's model
  only: the cache of each request comes from kvplugin's store (a stored prefix of the request
  is moved, not copied; a prefix shared with another conversation's entry is copied; restored
  to full precision) or is made by ``KVService.make_cache``
  (``--max-kv-size``: bounded, pre-allocated rotating caches; ``--kv-cache-step``); after the
  request the cache (prompt + output) is handed back to the store, which trims, quantizes
  (per settings) and budgets it. The host's own partial caches of that path (the system-prefix
  snapshot LRU, which ignores every flag, and the opt-in ``--prefix-trie-cache``) are switched
  off: kvplugin's store serves shared prefixes (by a prefix copy) and whole conversations.
* ``--continuous-batching``: ``vllm_mlx.scheduler.MemoryAwarePrefixCache`` (a by-name import
  used only by ``Scheduler.__init__``) is replaced by :class:`KVPrefixCache`, a subclass whose
  store/fetch/persistence go through the same ``KVService`` and which keeps the private fields
  the scheduler reads (``_entries``, ``_current_memory``, ``_last_match_type``,
  ``_last_matched_key``). Budget: the host's ``MemoryCacheConfig.compute_memory_limit()``
  (``--cache-memory-mb`` / ``--cache-memory-percent``). ``Scheduler.ensure_ssd_tier`` becomes a
  no-op for it (kvplugin's cold tier is ``--ssd-cache-dir``). ``--max-kv-size`` keeps using the
  host's own bounding (``_bound_cache_layers``, with kvplugin's resolved value); the batch
  caches it feeds are pre-allocated to the bound (``BatchRotatingKVCache.step``), and
  ``--kv-cache-step`` sets ``BatchKVCache.step``.
* Persistence: without ``--hot-cache-only`` the host's shut-down save / start-up load of the
  prefix cache (``save_to_disk``/``load_from_disk``, batching mode) are
  ``KVService.persist``/``restore``, whose cold tier comes from ``kvplugin_store_backend``: ``--ssd-cache-dir`` if given, else ``<vllm-mlx's prefix-cache dir>/kvplugin`` (never
  mixed with vllm-mlx's own files), written at shut-down only, read lazily on the first hit;
  quantized entries stay quantized. Default mode persists only with ``--ssd-cache-dir``. With
  it, every engine's ``save_cache_to_disk``/``load_cache_from_disk`` is a no-op and no cold
  tier exists: evictions are discarded and nothing of the prefix cache reaches the disk.
* Metrics: a Prometheus collector with kvplugin's counters is registered on the host's
  ``/metrics`` registry (``--enable-metrics``), and ``GET /kvplugin/stats`` returns
  ``KVService.stats()`` plus the stored entries as JSON (the mlx-lm adapter's shape).

Modes kvplugin does not back (paged cache, ``--no-memory-aware-cache``, multimodal models,
``--disable-prefix-cache``) are announced in one ``kvplugin:`` line at start-up.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet

from kvplugin.hosts.base import STATS_PATH, HostAdapter, PatchRegistry, fail_start, require_attrs
from kvplugin.hostspecs import VLLM_MLX
from kvplugin.log import say

PERSIST_SUBDIR = "kvplugin"  # under the host's prefix-cache directory: never mixes with its files


# =============================================================================================
# identity


def _distribution_owns(dist: importlib.metadata.Distribution, path: Path) -> bool:
    """True if ``path`` (a file of the imported package) is one of ``dist``'s files."""
    try:
        target = path.resolve()
    except OSError:
        return False
    for f in dist.files or ():
        if f.name == path.name and f.parts[:1] == ("vllm_mlx",):
            try:
                if Path(dist.locate_file(f)).resolve() == target:
                    return True
            except OSError:
                continue
    # An editable install records no package files; it records where the source lives.
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except (OSError, ValueError):
        return False
    url = direct.get("url", "")
    if direct.get("dir_info", {}).get("editable") and url.startswith("file://"):
        root = Path(url[len("file://") :]).resolve()
        return root in target.parents
    return False


# =============================================================================================
# runtime state of one serving process


class _Runtime:
    """Everything stage 2 decided for this process (one ``serve`` per process)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.settings: Any = None
        self.service: Any = None
        self.model_id: str | None = None  # args.model (path or repo id)
        self.mode = "simple"
        self.simple_models: dict[int, str] = {}  # id(nn.Module) -> store model key
        self.given_flags: dict[str, Any] = {}  # settings given as flags (for messages)
        self.group_size_checked = False
        self._model_fp: str | None = None

    # -- keys -------------------------------------------------------------------------------
    def model_key(self, model: Any = None) -> str:
        """The store's model key: the served checkpoint's fingerprint (shared with the mlx-lm
        adapter: path + config/tokenizer contents + weight sizes/mtimes + mlx-lm minor), so
        entries persisted on disk are never served to another checkpoint, and the bound, so
        entries built under another ``--max-kv-size`` are not either."""
        bound = self.settings.max_kv_size or 0
        if self.model_id:
            if self._model_fp is None:
                from kvplugin.cache.fingerprint import model_fingerprint

                self._model_fp = model_fingerprint(str(self.model_id))
            base = self._model_fp
        else:  # --models-config: several models, identified by their architecture
            base = _fingerprint(model)
        return f"vllm-mlx|{base}|max_kv={bound}"


_RT = _Runtime()


def _fingerprint(model: Any) -> str:
    try:
        from vllm_mlx import memory_cache

        return str(memory_cache._compute_model_fingerprint(model))
    except Exception:
        return f"model-{id(model)}"


# =============================================================================================
# the adapter


class VllmMlxAdapter(HostAdapter):
    name, distribution, trigger_module = (VLLM_MLX.name, VLLM_MLX.distribution,
                                          VLLM_MLX.trigger_module)
    supported = SpecifierSet(VLLM_MLX.supported)

    def __init__(self) -> None:
        super().__init__()
        self.serving = PatchRegistry()  # stage 2, undone on its own if it fails
        self.serving_installed = False

    def check_identity(self, module: Any) -> str | None:
        """``vllm_mlx`` must be the ``vllm-mlx`` distribution's (rapid-mlx ships one too)."""
        path = getattr(module, "__file__", None)
        if not path:
            return "vllm_mlx.cli has no __file__"
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"{self.distribution} is not installed"
        if not _distribution_owns(dist, Path(path)):
            owners = [
                d.metadata["Name"]
                for d in importlib.metadata.distributions()
                if d.metadata["Name"] not in (None, self.distribution)
                and _distribution_owns(d, Path(path))
            ]
            by = f" (it belongs to {', '.join(owners)})" if owners else ""
            return f"the imported vllm_mlx ({Path(path).parent}) is not vllm-mlx's{by}"
        return None

    # -- stage 1 --------------------------------------------------------------------------
    def apply(self, module: Any, patches: PatchRegistry) -> None:
        cli = module
        for name in ("create_parser", "serve_command"):
            if not callable(getattr(cli, name, None)):
                raise AttributeError(f"vllm_mlx.cli.{name} is missing")
        if inspect.signature(cli.create_parser).parameters:
            raise TypeError("vllm_mlx.cli.create_parser takes arguments")
        if len(inspect.signature(cli.serve_command).parameters) != 1:
            raise TypeError("vllm_mlx.cli.serve_command(args) changed its signature")
        original_create = cli.create_parser
        create = _wrap_create_parser(original_create)
        patches.replace(cli, "create_parser", create)
        if getattr(cli, "build_parser", None) is original_create:
            patches.replace(cli, "build_parser", create)
        patches.replace(cli, "serve_command", _wrap_serve_command(cli.serve_command, self))

    # -- stage 2 --------------------------------------------------------------------------
    def install_serving(self, args: argparse.Namespace, settings: Any) -> bool:
        """Patch the serving seams (all or none). False: the host serves stock.

        A ``SettingsError`` (a plugin's ``kvplugin_configure`` refusing the configuration,
        or a broken plugin) stops the server as on every host: serving stock would ignore
        what the user asked for.
        """
        from kvplugin.settings import SettingsError

        with self._lock:
            if self.serving_installed:
                return True
            try:
                _install_serving(self.serving, args, settings)
            except SettingsError as exc:
                self.serving.restore_all()
                _RT.service = None
                fail_start(str(exc))
            except Exception as exc:
                self.serving.restore_all()  # the CLI wrapping stays: settings are resolved
                _RT.service = None
                say(
                    f"could not patch vllm-mlx's serving path ({type(exc).__name__}: {exc}); "
                    "the server runs stock (flags as vllm-mlx implements them)",
                    key="failed:vllm-mlx:serve",
                )
                return False
            self.serving_installed = True
            return True

    def uninstall(self) -> None:
        with self._lock:
            self.serving.restore_all()
            self.serving_installed = False
        super().uninstall()


ADAPTER = VllmMlxAdapter()


def on_import(module: Any) -> None:
    ADAPTER.install(module)


# =============================================================================================
# stage 1: parser and serve_command

_SERVE_PARSER: list = []  # the serve subparser of the last parser built (argparse keeps no link)


def _serve_subparser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser | None:
    for action in getattr(parser, "_actions", ()):
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get("serve")
    return None


def _wrap_create_parser(original):
    @functools.wraps(original)
    def create_parser(*a, **kw):
        parser = original(*a, **kw)
        serve = _serve_subparser(parser)
        if serve is not None:
            from kvplugin.options import add_options

            add_options(serve)
            _SERVE_PARSER[:] = [serve]
        return parser

    create_parser.__kvplugin_original__ = original  # type: ignore[attr-defined]
    return create_parser


def _wrap_serve_command(original, adapter: VllmMlxAdapter):
    @functools.wraps(original)
    def serve_command(args):
        from kvplugin.options import given_flags, settings_from_namespace
        from kvplugin.settings import SettingsError, resolve_settings

        try:
            if _SERVE_PARSER:
                _RT.given_flags = given_flags(_SERVE_PARSER[0], args)
                settings = settings_from_namespace(_SERVE_PARSER[0], args)
            else:  # args built by someone else's parser: env and defaults only
                settings = resolve_settings({})
        except SettingsError as exc:
            fail_start(str(exc))
        _RT.settings = settings
        _RT.model_id = getattr(args, "model", None)
        _RT.mode = "batching" if getattr(args, "continuous_batching", False) else "simple"
        _early_group_size_check(args, settings)
        if adapter.install_serving(args, settings):
            _announce(args, settings)
        elif settings.hot_cache_only:  # fail closed: stock vllm-mlx would write its cache
            fail_start(
                "kvplugin: --hot-cache-only (KVPLUGIN_HOT_CACHE_ONLY) cannot be honoured "
                "because kvplugin could not patch vllm-mlx (see above); not starting"
            )
        return original(args)

    serve_command.__kvplugin_original__ = original  # type: ignore[attr-defined]
    return serve_command


# =============================================================================================
# group size vs head dimension


def _config_of(path: str | os.PathLike | None) -> dict | None:
    """``config.json`` of a local model directory or an already cached HF repo (no I/O else)."""
    if not path:
        return None
    p = Path(str(path)).expanduser()
    cfg = p / "config.json"
    if not cfg.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(str(path), "config.json")
        except Exception:
            found = None
        if not isinstance(found, str):
            return None
        cfg = Path(found)
    try:
        return json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None


def _check_group_size(model_like: Any, *, hard: bool = False) -> None:
    settings = _RT.settings
    if settings is None or _RT.group_size_checked:
        return
    problem = ADAPTER.model_problem(model_like, settings, _RT.given_flags)
    if problem is not None:
        fail_start(problem, hard=hard)
    _RT.group_size_checked = True


def _early_group_size_check(args: argparse.Namespace, settings: Any) -> None:
    if not settings.kv_cache_quantization:
        _RT.group_size_checked = True
        return
    config = _config_of(getattr(args, "model", None))
    if config is not None:
        _check_group_size({"args": config})


# =============================================================================================
# stage 2: the serving seams


def _install_serving(patches: PatchRegistry, args: argparse.Namespace, settings: Any) -> None:
    import mlx_lm

    gen_mod = sys.modules.get("mlx_lm.generate") or importlib.import_module("mlx_lm.generate")
    from mlx_lm.models import cache as mlc
    from vllm_mlx import memory_cache, metrics, scheduler, server
    from vllm_mlx.engine import batched, simple

    # ---- check every seam first --------------------------------------------------------
    require_attrs(gen_mod, "stream_generate")
    require_attrs(mlx_lm, "stream_generate")
    require_attrs(simple, "SimpleEngine", "build_system_prompt_cache_prefix")
    require_attrs(simple.SimpleEngine, "__init__", "start", "stop")
    require_attrs(scheduler, "MemoryAwarePrefixCache", "Scheduler")
    require_attrs(scheduler.Scheduler, "ensure_ssd_tier")
    if scheduler.MemoryAwarePrefixCache is not memory_cache.MemoryAwarePrefixCache:
        raise TypeError("vllm_mlx.scheduler.MemoryAwarePrefixCache is not memory_cache's")
    require_attrs(memory_cache, "MemoryCacheConfig", "_detach_cache_for_storage")
    require_attrs(memory_cache.MemoryCacheConfig, "compute_memory_limit")
    require_attrs(batched, "BatchedEngine")
    require_attrs(batched.BatchedEngine, "save_cache_to_disk", "load_cache_from_disk")
    require_attrs(server, "load_model", "app")
    require_attrs(metrics, "MetricsCollector")
    require_attrs(metrics.MetricsCollector, "_init_prometheus")
    require_attrs(mlc, "BatchKVCache", "BatchRotatingKVCache", "make_prompt_cache")
    params = inspect.signature(simple.SimpleEngine.__init__).parameters
    if "max_kv_size" not in params:
        raise TypeError("SimpleEngine.__init__ has no max_kv_size (vllm-mlx < 0.3?)")
    if not inspect.iscoroutinefunction(simple.SimpleEngine.start):
        raise TypeError("SimpleEngine.start is not a coroutine")
    sg = inspect.signature(gen_mod.stream_generate).parameters
    if list(sg)[:3] != ["model", "tokenizer", "prompt"]:
        raise TypeError("mlx_lm.stream_generate(model, tokenizer, prompt, ...) changed")
    router = getattr(server.app, "router", None)
    if not isinstance(getattr(router, "routes", None), list) or "routes" not in vars(router):
        raise TypeError("vllm_mlx.server.app.router.routes is not a list")

    # ---- the store -------------------------------------------------------------------------
    _RT.service = _make_service(settings, args, memory_cache)
    atexit.register(_close_at_exit)  # shut-down: store closed, then kvplugin_unconfigure
    from kvplugin.cache.prealloc import register_with_mlx_lm

    register_with_mlx_lm(patches)

    # ---- default (simple) mode -------------------------------------------------------------
    wrapped = _wrap_stream_generate(gen_mod.stream_generate)
    patches.replace(gen_mod, "stream_generate", wrapped)
    if mlx_lm.stream_generate is not wrapped:
        patches.replace(mlx_lm, "stream_generate", wrapped)
    patches.replace(
        simple, "build_system_prompt_cache_prefix", _no_system_prefix_snapshot
    )
    se = simple.SimpleEngine
    patches.replace(se, "__init__", _wrap_simple_init(se.__init__))
    patches.replace(se, "start", _wrap_simple_start(se.start))
    patches.replace(se, "stop", _wrap_simple_stop(se.stop))

    # ---- batching mode ---------------------------------------------------------------------
    prefix_cls = _make_prefix_cache_class(memory_cache)
    patches.replace(scheduler, "MemoryAwarePrefixCache", prefix_cls)
    patches.replace(
        scheduler.Scheduler, "ensure_ssd_tier", _wrap_ensure_ssd_tier(scheduler.Scheduler.ensure_ssd_tier)
    )
    if _RT.mode == "batching":  # the batch caches every request is merged into
        for cls, step in _RT.service.batch_steps().items():
            patches.replace(getattr(mlc, cls), "step", step)

    # ---- persistence -----------------------------------------------------------------------
    if not _RT.service.may_persist():
        be = batched.BatchedEngine
        patches.replace(be, "save_cache_to_disk", _no_save)
        patches.replace(be, "load_cache_from_disk", _no_load)
        for name, fn in (
            ("_save_cache_to_disk_on_owner", _no_save_async),
            ("_load_cache_from_disk_on_owner", _no_load_async),
        ):
            if hasattr(be, name):
                patches.replace(be, name, fn)

    # ---- group size from the resolved model path (0.6.0 passes it), metrics, route ---------
    patches.replace(server, "load_model", _wrap_load_model(server.load_model))
    mc = metrics.MetricsCollector
    patches.replace(mc, "_init_prometheus", _wrap_init_prometheus(mc._init_prometheus))
    _register_collector(getattr(metrics, "metrics", None))  # already initialised (rare)
    patches.replace(router, "routes", [*router.routes, _stats_route()])


def _make_service(settings: Any, args: argparse.Namespace, memory_cache: Any) -> Any:
    config = memory_cache.MemoryCacheConfig(
        max_memory_mb=getattr(args, "cache_memory_mb", None),
        max_memory_percent=getattr(args, "cache_memory_percent", 0.20) or 0.20,
    )
    return ADAPTER.make_session(
        settings,
        max_bytes=int(config.compute_memory_limit()),
        max_entries=int(getattr(config, "max_entries", 1000) or 1000),
    )


def _close_at_exit() -> None:
    service = _RT.service
    if service is not None:
        service.close()


# =============================================================================================
# start-up line(s)


def _announce(args: argparse.Namespace, settings: Any) -> None:
    not_applied = []
    where = None
    if _RT.mode == "batching":
        if getattr(args, "use_paged_cache", False):
            where = "--use-paged-cache"
        elif getattr(args, "no_memory_aware_cache", False):
            where = "--no-memory-aware-cache"
        elif getattr(args, "disable_prefix_cache", False) or not getattr(
            args, "enable_prefix_cache", True
        ):
            where = "--disable-prefix-cache"
    if where is not None:
        hot = (
            "; --hot-cache-only still keeps vllm-mlx from saving its cache to disk"
            if settings.hot_cache_only
            else ""
        )
        say(
            f"not applied: {where}: vllm-mlx's prefix cache in this mode is not kvplugin's, "
            "so --kv-cache-quantization*, --kv-cache-min-quantize-tokens, --ssd-cache-dir and "
            f"kvplugin's store are not used (--max-kv-size is applied by vllm-mlx){hot}",
            key="vllm-mlx:not-applied",
        )
        return
    if _RT.mode == "simple":
        for flag, dest in (
            ("--enable-mtp", "enable_mtp"),
            ("--specprefill", "specprefill"),
        ):
            if getattr(args, dest, False):
                not_applied.append(
                    f"{flag}: requests on that path use vllm-mlx's own cache handling"
                )
        if getattr(args, "prefix_trie_cache", False):
            not_applied.append(
                "--prefix-trie-cache: replaced by kvplugin's prompt store (same role, "
                "kvplugin's budget and flags)"
            )
    if not_applied:
        say("not applied: " + "; ".join(not_applied), key="vllm-mlx:not-applied")
    if _RT.service is not None:
        mode = "--continuous-batching" if _RT.mode == "batching" else "default (simple) mode"
        ADAPTER.say_active(_RT.service, mode=mode)


def _mllm_notice() -> None:
    say(
        "multimodal model: vllm-mlx's MLLM prompt cache is not kvplugin's, so kvplugin's "
        "store, quantization, --max-kv-size and --hot-cache-only are not applied to it",
        key="vllm-mlx:mllm",
    )


# =============================================================================================
# default (simple) mode


def _no_system_prefix_snapshot(*args: Any, **kwargs: Any) -> None:
    """Replaces ``engine.simple.build_system_prompt_cache_prefix``: no system-prefix snapshot.

    That LRU (``VLLM_MLX_SYSTEM_KV_SLOTS``) copies snapshots and ignores every cache flag; with
    kvplugin the request goes down the plain path, whose cache is kvplugin's store.
    """
    return None


def _wrap_simple_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "_is_mllm", False):
            _mllm_notice()
            return
        # kvplugin's store takes the role of the optional mlx-lm trie cache
        self._prefix_trie_cache_enabled = False

    return __init__


def _engine_nn_model(engine: Any) -> Any:
    wrapper = getattr(engine, "_model", None)
    return getattr(wrapper, "model", None)


def _wrap_simple_start(original):
    @functools.wraps(original)
    async def start(self, *args, **kwargs):
        result = await original(self, *args, **kwargs)
        if not getattr(self, "_is_mllm", False) and _RT.service is not None:
            model = _engine_nn_model(self)
            if model is not None:
                _check_group_size(model, hard=True)
                with _RT.lock:
                    _RT.simple_models[id(model)] = _RT.model_key(model)
        return result

    return start


def _wrap_simple_stop(original):
    @functools.wraps(original)
    async def stop(self, *args, **kwargs):
        model = _engine_nn_model(self)
        try:
            return await original(self, *args, **kwargs)
        finally:
            if model is not None:
                with _RT.lock:
                    registered = _RT.simple_models.pop(id(model), None)
                # an explicit --ssd-cache-dir keeps the hot entries across a restart
                if registered is not None and _RT.service is not None:
                    _RT.service.flush_configured()

    return stop


def _tokens_of(tokenizer: Any, prompt: Any) -> list[int]:
    """The prompt tokens exactly as ``mlx_lm.stream_generate`` computes them."""
    import mlx.core as mx

    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    return [int(t) for t in prompt]


_BYPASS_KWARGS = ("prompt_cache", "input_embeddings", "kv_bits", "num_draft_tokens")


def _wrap_stream_generate(original):
    """``mlx_lm.stream_generate`` whose cache comes from / goes back to kvplugin's store.

    Engages only for models a kvplugin-managed ``SimpleEngine`` registered, and only for a
    plain call (no draft model, no caller-made cache, no embeddings, no live quantization).
    With logits processors the prefix is not reused (they would only see the uncached tail
    of the context) but the result is still stored.
    """

    @functools.wraps(original)
    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
        key = _RT.simple_models.get(id(model))
        service = _RT.service
        if (
            key is None
            or service is None
            or draft_model is not None
            or any(kwargs.get(k) is not None for k in _BYPASS_KWARGS)
        ):
            yield from original(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)
            return
        yield from _cached_generation(
            original, service, key, model, tokenizer, prompt, max_tokens, kwargs
        )

    stream_generate.__kvplugin_original__ = original  # type: ignore[attr-defined]
    return stream_generate


def _cached_generation(original, service, key, model, tokenizer, prompt, max_tokens, kwargs):
    import dataclasses

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    tokens = _tokens_of(tokenizer, prompt)
    cache, n = None, 0
    if len(tokens) >= 2 and not kwargs.get("logits_processors"):
        cache, n = service.fetch(key, tokens)
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
            _give_back(service, key, tokens + generated, cache)


def _give_back(service: Any, key: str, sequence: list[int], cache: list) -> None:
    """Hand a finished request's cache to the store (keyed by exactly what it holds)."""
    try:
        service.give_back(key, sequence, cache, min_tokens=2)
    except Exception as exc:  # never fail a finished request because of the store
        say(f"storing a prompt cache failed ({type(exc).__name__}: {exc})", key="store-failed")


# =============================================================================================
# batching mode: MemoryAwarePrefixCache backed by the KVService


class _Sized:
    """Stands in for ``MemoryAwarePrefixCache._entries`` (the scheduler only takes ``len``)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return len(self._owner)

    def __bool__(self) -> bool:
        return len(self) > 0


def _make_prefix_cache_class(memory_cache: Any):
    host_cls = memory_cache.MemoryAwarePrefixCache
    mb = 1024 * 1024

    class KVPrefixCache(host_cls):  # type: ignore[misc, valid-type]
        """``MemoryAwarePrefixCache`` whose entries live in kvplugin's store.

        * ``store`` keys an entry by the tokens its cache really holds (``offset``), trims it,
          quantizes it per kvplugin's settings and hands it to the store (no extra copy of
          layers trim/quantize already copied; others are detached like the host does).
        * ``fetch`` is the store's longest-prefix lookup: a prefix entry is *moved* to the
          request (no copy; the batch merge is the only copy), a shared prefix of another
          conversation's entry is copied; at least one token is always left to prefill, so
          the scheduler never hits its exact-match re-prefill path. Quantized entries come
          back dequantized.
        * Below the host's ``min_prefix_tokens`` (128) nothing is stored or fetched, as stock.
        """

        kvplugin = True

        def __init__(self, model: Any, config: Any = None) -> None:  # no super(): no host state
            self._config = config or memory_cache.MemoryCacheConfig()
            self._service = _RT.service
            self._key = _RT.model_key(model)
            self._min_tokens = int(getattr(self._config, "min_prefix_tokens", 1) or 1)
            self._last_match_type = None
            self._last_matched_key = None
            self._ssd_tier = None
            self._model_id = id(model)
            self._memory_lock = threading.RLock()
            self._rejections = 0
            if _RT.settings is not None and _RT.settings.kv_cache_quantization:
                _check_group_size(model, hard=True)

        # -- what the scheduler reads directly -------------------------------------------
        @property
        def _entries(self) -> _Sized:
            return _Sized(self)

        @property
        def _current_memory(self) -> int:
            return self._service.store.nbytes

        @property
        def _max_memory(self) -> int:
            return self._service.store.max_bytes

        def __len__(self) -> int:
            return len(self._service.store)

        def __contains__(self, tokens: Any) -> bool:
            return False  # the store has no lookup without taking the entry

        # -- fetch / store -----------------------------------------------------------------
        def fetch(self, tokens: list[int]) -> tuple[list | None, list[int]]:
            self._last_matched_key = None
            if not tokens or len(tokens) < self._min_tokens:
                self._last_match_type = "miss"
                return None, tokens
            try:
                cache, n = self._service.fetch(self._key, tokens)
            except Exception as exc:
                say(f"prefix-cache fetch failed ({type(exc).__name__}: {exc})", key="fetch-failed")
                cache, n = None, 0
            if cache is None:
                self._last_match_type = "miss"
                return None, tokens
            _eval_entry(cache)
            self._last_match_type = "prefix"
            self._last_matched_key = tuple(tokens[:n])
            return cache, list(tokens[n:])

        def store(self, tokens: list[int], cache: list, evict_prefixes: bool = True) -> bool:
            prepared = self.prepare_store(tokens, cache)
            return prepared is not None and self.commit_prepared(prepared)

        def prepare_store(self, tokens: list[int], cache: list, auxiliary: Any = None) -> Any:
            if auxiliary or not tokens or not cache:
                return None
            try:
                from kvplugin.cache.layers import entry_tokens

                held = entry_tokens(cache)
                if held > len(tokens) or held < self._min_tokens:
                    return None
                entry = self._service.prepare_entry(list(cache), held)
                entry = _detach_shared_layers(entry, cache, memory_cache)
                return (tuple(tokens[:held]), entry)
            except Exception as exc:
                self._rejections += 1
                say(f"prefix-cache store failed ({type(exc).__name__}: {exc})", key="store-failed")
                return None

        def commit_prepared(self, entry: Any, evict_prefixes: bool = True, *, commit_lock=None, commit_guard=None) -> bool:
            if entry is None:
                return False
            if commit_guard is not None and not commit_guard():
                return False
            key, cache = entry
            ok = self._service.store.insert(self._key, list(key), cache)
            if not ok:
                self._rejections += 1
            return ok

        def clone_for_replay(self, cache: list) -> list | None:
            try:
                return memory_cache._detach_cache_for_storage(cache)
            except Exception:
                return None

        def fetch_exact_auxiliary(self, tokens: list[int]) -> None:
            return None

        def remove(self, tokens: list[int], *, include_ssd: bool = False) -> bool:
            return False  # fetched entries are already out of the store; others expire by LRU

        def clear(self) -> None:
            self._service.store.drop_all()  # drop, don't spill

        # -- stats -------------------------------------------------------------------------
        def get_stats(self) -> dict[str, Any]:
            s = self._service.store.stats()
            total = s.hits + s.misses
            limit = self._service.store.max_bytes
            return {
                "hits": s.hits,
                "misses": s.misses,
                "hit_rate": round(s.hits / total, 4) if total else 0.0,
                "evictions": s.evictions,
                "tokens_saved": s.tokens_reused,
                "current_memory_mb": round(s.bytes / mb, 2),
                "max_memory_mb": round(limit / mb, 2),
                "memory_utilization": round(s.bytes / limit, 4) if limit else 0.0,
                "entry_count": s.entries,
                "store_rejections": s.rejected + self._rejections,
                "backend": "kvplugin",
            }

        def reset_stats(self) -> None:
            return None

        @property
        def memory_usage_mb(self) -> float:
            return self._service.store.nbytes / mb

        @property
        def memory_limit_mb(self) -> float:
            return self._service.store.max_bytes / mb

        # -- the host's SSD tier is not used (kvplugin's cold tier is) ----------------------
        def try_reserve_memory(self, nbytes: int) -> bool:
            return False

        def release_reserved_memory(self, nbytes: int) -> None:
            return None

        def set_ssd_tier(self, ssd_tier: Any) -> None:
            self._ssd_tier = None

        def check_ssd(self, tokens: list[int]) -> None:
            return None

        # -- persistence ---------------------------------------------------------------------
        def save_to_disk(self, cache_dir: str) -> bool:
            return self._service.persist(_persist_dir(cache_dir))

        def load_from_disk(self, cache_dir: str) -> int:
            return self._service.restore(_persist_dir(cache_dir))

    KVPrefixCache.__qualname__ = "KVPrefixCache"
    KVPrefixCache.__module__ = __name__
    return KVPrefixCache


def _eval_entry(cache: list) -> None:
    """Evaluate a fetched entry here (a dequantized one is lazy) so no graph crosses threads."""
    import mlx.core as mx

    from kvplugin.cache.layers import entry_arrays

    arrays = entry_arrays(cache)
    if arrays:
        mx.eval(arrays)


def _detach_shared_layers(entry: list, source: list, memory_cache: Any) -> list:
    """Layers trim/quantize returned unchanged may still view the live batch: copy those."""
    same = [i for i, (a, b) in enumerate(zip(entry, source)) if a is b]
    if not same:
        return entry
    detached = memory_cache._detach_cache_for_storage([entry[i] for i in same])
    out = list(entry)
    for i, layer in zip(same, detached):
        out[i] = layer
    return out


def _wrap_ensure_ssd_tier(original):
    @functools.wraps(original)
    def ensure_ssd_tier(self, *args, **kwargs):
        if getattr(getattr(self, "memory_aware_cache", None), "kvplugin", False):
            return None  # kvplugin's store has its own cold tier (--ssd-cache-dir)
        return original(self, *args, **kwargs)

    return ensure_ssd_tier


# =============================================================================================
# persistence


def _persist_dir(cache_dir: str) -> Path:
    """kvplugin's files under the host's prefix-cache directory (never mixed with its own)."""
    return Path(cache_dir).expanduser() / PERSIST_SUBDIR


def _no_save(self, cache_dir: str) -> bool:
    return False


def _no_load(self, cache_dir: str) -> int:
    return 0


async def _no_save_async(self, cache_dir: str) -> bool:
    return False


async def _no_load_async(self, cache_dir: str) -> int:
    return 0


# =============================================================================================
# load_model: the group-size check once the model path is resolved


def _wrap_load_model(original):
    @functools.wraps(original)
    def load_model(*args, **kwargs):
        if not _RT.group_size_checked and _RT.settings is not None:
            path = kwargs.get("model_path") or kwargs.get("model_name") or (args[0] if args else None)
            config = _config_of(path)
            if config is not None:
                _check_group_size({"args": config})
        result = original(*args, **kwargs)
        try:
            from vllm_mlx import server

            engine = getattr(server, "_engine", None)
            if engine is not None and getattr(engine, "_is_mllm", False):
                _mllm_notice()
        except Exception:
            pass
        return result

    return load_model


# =============================================================================================
# metrics and the stats route


_COUNTERS = (
    # (name, help, stats key)
    ("entries_stored", "Prompt-cache entries kvplugin prepared for storage.", "entries_stored"),
    ("entries_quantized", "Entries stored quantized.", "entries_quantized"),
    ("bytes_saved", "Bytes saved by trimming and quantization (live size - stored size).", "bytes_saved"),
    ("hits", "Prompt-cache lookups that reused a stored prefix.", "store_hits"),
    ("misses", "Prompt-cache lookups without a usable prefix.", "store_misses"),
    ("evictions", "Entries evicted from the hot tier.", "store_evictions"),
    ("spills", "Evicted entries written to the cold (SSD) tier.", "store_spills"),
    ("cold_hits", "Hits served from the cold (SSD) tier.", "store_cold_hits"),
    ("discarded", "Evicted entries dropped (no cold tier, or it refused).", "store_discarded"),
    ("tokens_reused", "Prompt tokens served from the cache.", "store_tokens_reused"),
)
_GAUGES = (
    ("entries", "Entries in the hot tier.", "store_entries"),
    ("bytes", "Bytes held by the hot tier.", "store_bytes"),
    ("cold_entries", "Entries in the cold tier (-1: none).", "store_cold_entries"),
)


class _KVCollector:
    """Prometheus collector: ``kvplugin_*`` counters from ``KVService.stats()``."""

    def describe(self):
        return list(self._families({}))

    def collect(self):
        service = _RT.service
        return list(self._families(service.stats() if service is not None else {}))

    @staticmethod
    def _families(stats: dict):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, text, key in _COUNTERS:
            fam = CounterMetricFamily(f"kvplugin_{name}", text)
            if key in stats:
                fam.add_metric([], float(stats[key]))
            yield fam
        for name, text, key in _GAUGES:
            fam = GaugeMetricFamily(f"kvplugin_{name}", text)
            if key in stats:
                fam.add_metric([], float(stats[key]))
            yield fam


def _register_collector(collector_owner: Any) -> None:
    prom = getattr(collector_owner, "_prom", None)
    if not isinstance(prom, dict) or "registry" not in prom:
        return
    registry = prom["registry"]
    if getattr(registry, "_kvplugin_registered", False):
        return
    registry.register(_KVCollector())
    registry._kvplugin_registered = True


def _wrap_init_prometheus(original):
    @functools.wraps(original)
    def _init_prometheus(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            _register_collector(self)
        except Exception as exc:
            say(f"kvplugin counters not on /metrics ({type(exc).__name__}: {exc})", key="metrics")
        return result

    return _init_prometheus


def stats_report(service: Any) -> dict:
    """``KVService.report()`` (counters + stored entries, the shape every host serves at
    ``/kvplugin/stats``) plus ``host_version`` (as the mlx-lm adapter) and ``mode``."""
    return ADAPTER.report(
        service, mode="continuous-batching" if _RT.mode == "batching" else "simple"
    )


def _stats_route():
    from fastapi import APIRouter

    async def kvplugin_stats():
        service = _RT.service
        if service is None:
            return {"host": "vllm-mlx", "active": False}
        return stats_report(service)

    router = APIRouter()
    router.add_api_route(STATS_PATH, kvplugin_stats, methods=["GET"], include_in_schema=False)
    return router.routes[0]
