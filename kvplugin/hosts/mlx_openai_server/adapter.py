"""The mlx-openai-server adapter: the server's seams checked, then patched through one registry
(all or none); the child's seams when it builds its first language-model handler; the
process's service. The seams are listed in :mod:`kvplugin.hosts.mlx_openai_server`.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import HostAdapter, PatchRegistry, fail_start, require, wraps_original
from kvplugin.hostspecs import MLX_OPENAI_SERVER
from kvplugin.log import say

__all__ = ["ADAPTER", "MlxOpenaiServerAdapter", "on_import"]

#: the host's ``--max-bytes`` default (1 << 63) and anything that large: no byte budget
_NO_BUDGET = 1 << 62


def spawned_child() -> bool:
    """True in the host's model process (a ``multiprocessing`` child, named before it imports
    the server's modules): what its parent said at start-up is not said again."""
    import multiprocessing

    return multiprocessing.current_process().name != "MainProcess"


class MlxOpenaiServerAdapter(HostAdapter, declaration=MLX_OPENAI_SERVER):
    """``mlx-openai-server launch`` backed by kvplugin's engine
    (:data:`~kvplugin.hostspecs.MLX_OPENAI_SERVER`)."""

    def __init__(self) -> None:
        super().__init__()
        self._state_lock = threading.Lock()
        self.settings: Any = None  # the server's, resolved by the wrapped launch
        self.given_flags: dict[str, Any] = {}
        self.service: Any = None  # the child's service (one per model process)
        self.child_patches = PatchRegistry()  # the child's seams, patched on its first lm handler
        self._child_state = "pending"  # pending -> patched | stock
        self._cache_mod: Any = None  # mlx_lm.models.cache, set by the child's install

    # -- install -----------------------------------------------------------------------
    def install(self, module: Any) -> bool:
        if spawned_child() and self.support_problem(module) is not None:
            return False  # the server process said it, once
        return super().install(module)

    def apply(self, module: Any, patches: PatchRegistry) -> None:
        server = module
        for name in ("setup_server", "create_handler_from_config", "HandlerProcessProxy"):
            require(hasattr(server, name), f"app.server.{name} is missing")
        require(list(inspect.signature(server.create_handler_from_config).parameters)
                == ["model_cfg"], "app.server.create_handler_from_config(model_cfg)")
        require(list(inspect.signature(server.setup_server).parameters) == ["config_args"],
                "app.server.setup_server(config_args)")
        for name in ("_call", "_wait_for_ready"):
            require(callable(getattr(server.HandlerProcessProxy, name, None)),
                    f"HandlerProcessProxy.{name}")
        from kvplugin.hosts.mlx_openai_server.routes import wrap_setup_server

        patches.replace(server, "setup_server", wrap_setup_server(server.setup_server, server))
        patches.replace(server, "create_handler_from_config",
                        self._wrap_create_handler(server.create_handler_from_config))
        proxy = server.HandlerProcessProxy
        patches.replace(proxy, "_wait_for_ready", _wrap_wait_for_ready(proxy._wait_for_ready))

    def add_options(self, cli: Any) -> None:
        """``app.cli`` finished importing (server process): kvplugin's options on ``launch``."""
        with self._lock:
            if not self.installed:
                return
            try:
                from kvplugin.hosts.mlx_openai_server.options import install_options

                install_options(self, cli, self.registry)
            except Exception as exc:
                self.registry.restore_all()
                self.installed = False
                say(f"could not patch {self.name} ({type(exc).__name__}: {exc}); "
                    f"{self.name} runs stock", key=f"failed:{self.name}")

    def _wrap_create_handler(self, original: Callable) -> Callable:
        adapter = self

        @wraps_original(original)
        def create_handler_from_config(model_cfg: Any) -> Any:
            if getattr(model_cfg, "model_type", None) == "lm":
                adapter.install_child()
            return original(model_cfg)

        return create_handler_from_config

    def install_child(self) -> None:
        """The model process's seams, once, all or none (a failure leaves the child stock)."""
        with self._state_lock:
            if self._child_state != "pending":
                return
            from kvplugin.hosts.mlx_openai_server.handler import install_child

            try:
                install_child(self, self.child_patches)
                self._child_state = "patched"
            except Exception as exc:
                self.child_patches.restore_all()
                self._child_state = "stock"
                say(f"could not patch {self.name}'s model process ({type(exc).__name__}: "
                    f"{exc}); it runs stock", key=f"failed-child:{self.name}")

    # -- settings and service (model process) --------------------------------------------
    def create_service(self, *, max_bytes: int | None, max_entries: int | None,
                       cache_dir: Any = None) -> tuple[Any, Any]:
        """The model process's service and the private directory of its entries (or None),
        from the settings the server handed down (:meth:`build_service`), with the child's
        batch caches patched. A bad value stops it."""
        from kvplugin.settings import SettingsError

        try:
            service, scratch = self.build_service(
                cache_dir, None if max_bytes is None or max_bytes >= _NO_BUDGET
                else int(max_bytes), max_entries=max_entries)
        except SettingsError as err:
            fail_start(str(err), hard=True)
        with self._state_lock:
            self.settings = service.settings
            self.service = service
        for cls, step in service.batch_plan().steps.items():  # BatchGenerator's caches
            self.child_patches.replace(getattr(self._cache_mod, cls), "step", step)
        self.say_active(service)
        return service, scratch

    def build_service(self, cache_dir: Any, max_bytes: int | None, *,
                      max_entries: int | None = None,
                      flags: Any = None) -> tuple[Any, Any]:
        """The service as this host runs it, entries kept where :func:`where_entries_live`
        says (``flags``: settings given as flags); raises ``SettingsError``."""
        from kvplugin.hosts.mlx_openai_server.prompt_cache import where_entries_live

        settings, between_requests, scratch = where_entries_live(cache_dir, max_bytes, flags)
        service = self.make_session(settings, max_bytes=max_bytes, max_entries=max_entries)
        if between_requests:
            service.hold_between_requests()
        # Its single-request path serves a stored entry on another thread than the one that
        # built it: entries are evaluated when stored.
        service.evaluate_at_store = True
        return service, scratch

    # -- uninstall ---------------------------------------------------------------------------
    def uninstall(self) -> None:
        self.child_patches.restore_all()
        super().uninstall()
        with self._state_lock:
            self.service = None
            self._child_state = "pending"


def _wrap_wait_for_ready(original: Callable) -> Callable:
    """The model process stopped at start-up with exit code 2 (kvplugin's, or a plugin's,
    refusal of the configuration, said on the shared stderr): the server stops with it,
    before it listens, instead of the host's generic start-up failure."""

    @wraps_original(original)
    async def _wait_for_ready(proxy: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(proxy, *args, **kwargs)
        except RuntimeError:
            process = getattr(proxy, "_process", None)
            if process is not None and not process.is_alive() and process.exitcode == 2:
                fail_start("kvplugin: the model process refused to start (exit code 2; "
                           "its reason is above)", hard=True)
            raise

    return _wait_for_ready


ADAPTER = MlxOpenaiServerAdapter()


def on_import(module: Any) -> None:
    """The bootstrap's call: ``app.server`` installs the adapter, ``app.cli`` its options."""
    if module.__name__ == "app.cli":
        ADAPTER.add_options(module)
    else:
        ADAPTER.install(module)
