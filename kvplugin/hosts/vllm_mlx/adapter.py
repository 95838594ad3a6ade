"""The vllm-mlx adapter: identity, the CLI (stage 1) and start-up (stage 2 wiring).

Stage 1, on ``import vllm_mlx.cli`` (cheap: nothing heavy is imported):

* ``cli.create_parser`` (and its import-time alias ``build_parser``): the serve subparser
  gets kvplugin's options. vllm-mlx's own ``--kv-cache-quantization*``,
  ``--kv-cache-min-quantize-tokens``, ``--max-kv-size``, ``--ssd-cache-dir`` and
  ``--ssd-cache-max-gb`` are *adopted* (same spelling, ``choices`` dropped so bits 2-8 pass,
  kvplugin validates); ``--hot-cache-only`` and ``--kv-cache-step`` are added.
* ``cli.serve_command``: resolves the settings (flag > env > default) and writes them back
  into the namespace, so host code sees the same values. A bad value exits with status 2
  and a message naming the flag and the variable, before anything is loaded. Then stage 2.

Stage 2, inside ``serve_command`` (the host imports ``vllm_mlx.server`` there anyway): every
seam of every mode is checked, the session is built, then :mod:`.simple`, :mod:`.batching`,
:mod:`.metrics` and :mod:`.salt` patch their seams, all through one :class:`PatchRegistry`
(all or none).
The model check (group size vs head dimension) runs from the model's ``config.json`` as soon
as the model path is known, else from the loaded model.

All state lives on the adapter instance (``given_flags``, the serve subparser) and in its
:class:`~.runtime.Runtime`; nothing is a module global except the ``ADAPTER`` singleton.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.metadata
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvplugin.hosts.base import (
    HostAdapter,
    PatchRegistry,
    config_of,
    fail_start,
    require_attrs,
    wraps_original,
)
from kvplugin.hosts.vllm_mlx import admission, batching, metrics, salt, simple
from kvplugin.hosts.vllm_mlx.runtime import Runtime
from kvplugin.hosts.vllm_mlx.startup import announce
from kvplugin.hostspecs import VLLM_MLX
from kvplugin.log import say


def distribution_owns(dist: importlib.metadata.Distribution, path: Path) -> bool:
    """True if ``path`` (a module's file) is one of ``dist``'s installed files."""
    try:
        target = path.resolve()
    except OSError:
        return False
    for f in dist.files or ():
        if f.name == path.name:
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


def owner_names(path: Path) -> list[str]:
    """The normalized names of the installed distributions that list ``path`` as a file."""
    names = (d.metadata["Name"] for d in importlib.metadata.distributions()
             if distribution_owns(d, path))
    return sorted({n.lower().replace("_", "-") for n in names if n})


def serve_subparser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser | None:
    """The ``serve`` subparser of vllm-mlx's top-level parser (argparse keeps no link back)."""
    for action in getattr(parser, "_actions", ()):
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get("serve")
    return None


class VllmMlxAdapter(HostAdapter, declaration=VLLM_MLX):
    """``vllm-mlx serve`` backed by kvplugin's engine (:data:`~kvplugin.hostspecs.VLLM_MLX`)."""

    def __init__(self) -> None:
        super().__init__()
        self.serving = PatchRegistry()  # stage 2, undone on its own if it fails
        self.serving_installed = False
        self.given_flags: dict[str, Any] = {}  # settings given as flags (for messages)
        self.serve_parser: argparse.ArgumentParser | None = None  # of the last parser built
        self.runtime = Runtime()
        self._at_exit: Callable[[], None] | None = None

    def check_identity(self, module: Any) -> str | None:
        """``vllm_mlx.cli`` must be a file of the ``vllm-mlx`` distribution: rapid-mlx ships
        a ``vllm_mlx`` package too (its real one in 0.14.2 and earlier, a redirect since),
        and a package by the right name is not the host whose seams kvplugin knows."""
        path = getattr(module, "__file__", None)
        if not path:
            return "vllm_mlx.cli has no __file__"
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            dist = None
        if dist is not None and distribution_owns(dist, Path(path)):
            return None
        owners = [n for n in owner_names(Path(path)) if n != self.distribution]
        if owners:
            return (f"the imported vllm_mlx.cli ({path}) belongs to {', '.join(owners)}, "
                    "not vllm-mlx")
        if dist is None:
            return f"{self.distribution} is not installed (vllm_mlx.cli is {path})"
        return f"the imported vllm_mlx.cli ({path}) is not a file of vllm-mlx"

    def support_problem(self, module: Any = None) -> str | None:
        """Identity first: a fork's version number says nothing about vllm-mlx's range."""
        problem = self.check_identity(module) if module is not None else None
        return problem or super().support_problem()

    def install(self, module: Any) -> bool:
        """A ``vllm_mlx`` of a host kvplugin recognizes (rapid-mlx 0.14.2 and earlier) says
        that host's start-up line instead of a vllm-mlx one."""
        if self.check_identity(module) is not None:
            from kvplugin.hosts.unsupported import adapter_for

            path = getattr(module, "__file__", None)
            for name in owner_names(Path(path)) if path else ():
                recognized = adapter_for(name)
                if recognized is not None:
                    return recognized.install(module)
        return super().install(module)

    # -- stage 1: the CLI -----------------------------------------------------------------
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
        create = self.wrap_create_parser(original_create)
        patches.replace(cli, "create_parser", create)
        if getattr(cli, "build_parser", None) is original_create:
            patches.replace(cli, "build_parser", create)
        patches.replace(cli, "serve_command", self.wrap_serve_command(cli.serve_command))

    def wrap_create_parser(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def create_parser(*a, **kw):
            parser = original(*a, **kw)
            serve = serve_subparser(parser)
            if serve is not None:
                from kvplugin.options import add_options

                add_options(serve)
                adapter.serve_parser = serve
            return parser

        return create_parser

    def wrap_serve_command(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def serve_command(args):
            adapter.start_serving(args)
            return original(args)

        return serve_command

    def resolve(self, args: argparse.Namespace) -> Any:
        """Settings from the serve namespace (flag > env > default); remembers which were
        given as flags. A bad value stops the server (status 2, flag and variable named)."""
        from kvplugin.options import given_flags, settings_from_namespace
        from kvplugin.settings import SettingsError, resolve_settings

        try:
            if self.serve_parser is not None:
                self.given_flags = given_flags(self.serve_parser, args)
                return settings_from_namespace(self.serve_parser, args)
            return resolve_settings({})  # args from someone else's parser: env and defaults
        except SettingsError as exc:
            fail_start(str(exc))

    def start_serving(self, args: argparse.Namespace) -> None:
        """What the wrapped ``serve_command`` does before the host's own code runs."""
        settings = self.resolve(args)
        rt = self.runtime
        rt.settings = settings
        rt.model_id = getattr(args, "model", None)
        rt.mode = "batching" if getattr(args, "continuous_batching", False) else "simple"
        self.early_model_check(args)
        if self.install_serving(args, settings):
            announce(self, args)
            return
        from kvplugin.cache.service.startup_checks import unpatched_problem  # lazy: mlx loads with the engine

        problem = unpatched_problem(settings, self.name)
        if problem is not None:
            fail_start(problem)

    # -- the model check ----------------------------------------------------------------
    def check_model(self, model_like: Any, *, hard: bool = False) -> None:
        """The session's model check, once: a mismatch stops the server (status 2)."""
        rt = self.runtime
        if rt.settings is None or rt.group_size_checked:
            return
        problem = self.model_problem(model_like, rt.settings, self.given_flags)
        if problem is not None:
            fail_start(problem, hard=hard)
        rt.group_size_checked = True

    def early_model_check(self, args: argparse.Namespace) -> None:
        """Before any weight loads: the check from ``config.json`` when the path is known."""
        config = config_of(getattr(args, "model", None))
        if config is not None:
            self.check_model({"args": config})

    # -- stage 2: the serving seams -------------------------------------------------------
    def install_serving(self, args: argparse.Namespace, settings: Any) -> bool:
        """Patch the serving seams (all or none). False: the host serves stock.

        A ``SettingsError`` (a plugin's ``kvplugin_configure`` refusing the configuration,
        a broken plugin, any failure to build the session: ``make_session``) stops the
        server as on every host: serving stock would ignore what the user asked for. Only
        a seam failing falls back to stock.
        """
        from kvplugin.settings import SettingsError

        with self._lock:
            if self.serving_installed:
                return True
            try:
                self._install_serving(self.serving, args, settings)
            except SettingsError as exc:
                self._undo_serving()
                fail_start(str(exc))
            except Exception as exc:
                self._undo_serving()  # the CLI wrapping stays: settings are resolved
                say(
                    f"could not patch vllm-mlx's serving path ({type(exc).__name__}: {exc}); "
                    "the server runs stock (flags as vllm-mlx implements them)",
                    key="failed:vllm-mlx:serve",
                )
                return False
            self.serving_installed = True
            return True

    def _install_serving(self, patches: PatchRegistry, args: argparse.Namespace,
                         settings: Any) -> None:
        import mlx_lm

        gen_mod = sys.modules.get("mlx_lm.generate") or importlib.import_module("mlx_lm.generate")
        from mlx_lm.models import cache as mlc
        from vllm_mlx import memory_cache, scheduler, server
        from vllm_mlx import request as request_mod
        from vllm_mlx import metrics as host_metrics
        from vllm_mlx.engine import batched
        from vllm_mlx.engine import simple as host_simple

        # every seam first: nothing is replaced unless all are there
        simple.check_seams(mlx_lm, gen_mod, host_simple)
        batching.check_seams(scheduler, memory_cache, batched, mlc)
        admission.check_seams(scheduler)
        metrics.check_seams(host_metrics, server)
        salt.check_seams(server, host_simple, request_mod, scheduler)
        require_attrs(server, "load_model")

        self.runtime.service = self._make_service(settings, args, memory_cache)
        self._at_exit = self._close_at_exit
        atexit.register(self._at_exit)  # shut-down: store closed, then kvplugin_unconfigure
        from kvplugin.cache.bounded.prealloc import register_with_mlx_lm

        register_with_mlx_lm(patches)
        simple.install(patches, self, mlx_lm, gen_mod, host_simple)
        batching.install(patches, self, scheduler, memory_cache, batched, mlc)
        admission.install(patches, self, scheduler)
        # the model check from the resolved model path (0.6.0 passes it)
        patches.replace(server, "load_model", self.wrap_load_model(server.load_model))
        metrics.install(patches, self, host_metrics, server)
        salt.install(patches, self, server, host_simple, request_mod, scheduler)

    def _make_service(self, settings: Any, args: argparse.Namespace, memory_cache: Any) -> Any:
        """The session, on the host's own budget (``--cache-memory-mb`` / ``-percent``)."""
        config = memory_cache.MemoryCacheConfig(
            max_memory_mb=getattr(args, "cache_memory_mb", None),
            max_memory_percent=getattr(args, "cache_memory_percent", 0.20) or 0.20,
        )
        return self.make_session(
            settings,
            max_bytes=int(config.compute_memory_limit()),
            max_entries=int(getattr(config, "max_entries", 1000) or 1000),
        )

    def _close_at_exit(self) -> None:
        service = self.runtime.service
        if service is not None:
            service.close()

    def _undo_serving(self) -> None:
        """Restore every serving patch and forget what stage 2 set up."""
        self.serving.restore_all()
        self.serving_installed = False
        metrics.unregister_collectors(self.runtime)
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        self.runtime.service = None

    def wrap_load_model(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def load_model(*args, **kwargs):
            if not adapter.runtime.group_size_checked and adapter.runtime.settings is not None:
                path = (kwargs.get("model_path") or kwargs.get("model_name")
                        or (args[0] if args else None))
                config = config_of(path)
                if config is not None:
                    adapter.check_model({"args": config})
            result = original(*args, **kwargs)
            try:
                from vllm_mlx import server

                engine = getattr(server, "_engine", None)
                if engine is not None and getattr(engine, "_is_mllm", False):
                    simple.say_mllm()
            except Exception:
                pass
            return result

        return load_model

    # -- report and uninstall -------------------------------------------------------------
    def stats_report(self, service: Any) -> dict:
        """``KVService.report()`` (counters + stored entries, the shape every host serves at
        ``/kvplugin/stats``) plus ``host_version`` (as the mlx-lm adapter) and ``mode``."""
        return self.report(service, mode=self.runtime.mode_label)

    def uninstall(self) -> None:
        """Undo both stages and forget every bit of state (a fresh runtime)."""
        with self._lock:
            self._undo_serving()
            self.runtime = Runtime()
            self.given_flags = {}
            self.serve_parser = None
        super().uninstall()


ADAPTER = VllmMlxAdapter()


def on_import(module: Any) -> None:
    ADAPTER.install(module)


__all__ = ["ADAPTER", "VllmMlxAdapter", "on_import"]
