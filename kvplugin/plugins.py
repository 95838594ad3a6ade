"""The plugin manager: kvplugin's default plugins plus third-party plugins from entry points.

Third parties register a module or object under the ``kvplugin`` entry-point group::

    [project.entry-points.kvplugin]
    myquant = "myquant.plugin"

Entry points are loaded once per process. ``KVPLUGIN_BLOCK_PLUGINS=name,name`` blocks
plugins by name: an entry-point name, or one of the default plugins (``trim``,
``quantize``, ``bound``, ``storage``) to replace just that one; ``builtin`` blocks all four
(mainly for tests of a replacement plugin).

The engine never imports this module: a host adapter passes ``get_plugin_manager().hook``
(the hook relay) to the session it builds.
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass

import pluggy

from kvplugin import hookspecs
from kvplugin.default_plugins import DEFAULT_PLUGINS
from kvplugin.log import say
from kvplugin.settings import SettingsError

BUILTIN_NAME = "builtin"  # blocks every default plugin at once
BLOCK_ENV = "KVPLUGIN_BLOCK_PLUGINS"

_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None


class PluginError(SettingsError):
    """An installed plugin cannot be used (a hook name kvplugin does not define).

    A :class:`SettingsError`, so every host stops at start-up with the message (exit 2)
    instead of serving with part of a plugin silently ignored.
    """


@dataclass(frozen=True)
class PluginInfo:
    name: str
    origin: str  # "builtin" (a default plugin) or "<distribution> <version>"


def _blocked_names() -> list[str]:
    names = [n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()]
    if BUILTIN_NAME in names:
        names += list(DEFAULT_PLUGINS)
    return names


def _refuse_newer_api(pm: pluggy.PluginManager) -> None:
    """Unregister plugins written against a newer hook contract than this kvplugin's."""
    for name, plugin in list(pm.list_name_plugin()):
        wanted = getattr(plugin, hookspecs.API_VERSION_ATTR, None)
        if isinstance(wanted, int) and wanted > hookspecs.HOOK_API_VERSION:
            pm.unregister(plugin)
            pm.set_blocked(name)
            say(
                f"plugin {name!r} needs hook API version {wanted}; this kvplugin speaks "
                f"version {hookspecs.HOOK_API_VERSION}: not loaded (upgrade kvplugin)",
                key=f"plugin-api:{name}",
            )


def _check_pending(pm: pluggy.PluginManager) -> None:
    """``pm.check_pending()``, with an error naming the plugin and the unknown hook.

    A hook implementation no spec matches is almost always a typo (``kvplugin_trim_entri``):
    silently never calling it would leave the user believing their plugin runs.
    """
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin = getattr(exc, "plugin", None)
        name = pm.get_name(plugin) if plugin is not None else None
        hooks = sorted(
            impl.function.__name__
            for caller in (pm.get_hookcallers(plugin) or () if plugin is not None else ())
            if caller.spec is None
            for impl in caller.get_hookimpls()
            if impl.plugin is plugin
        )
        raise PluginError(
            f"kvplugin: plugin {name or plugin!r} implements unknown hook "
            f"{', '.join(hooks) or '(see below)'} (misspelled? kvplugin.hookspecs lists the "
            f"hooks); fix it or block it with {BLOCK_ENV}={name} ({exc})"
        ) from exc


def create_plugin_manager(*, load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the hook specs, the default plugins and (optionally) entry points.

    Raises :class:`PluginError` when a plugin implements a hook that does not exist.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in _blocked_names():
        pm.set_blocked(name)
    for name, module in DEFAULT_PLUGINS.items():
        if not pm.is_blocked(name):
            pm.register(importlib.import_module(module), name=name)
    if load_entry_points:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    _refuse_newer_api(pm)
    _check_pending(pm)
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, created (and entry points loaded) on first use."""
    global _pm
    with _lock:
        if _pm is None:
            _pm = create_plugin_manager()
        return _pm


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests, or after installing a plugin)."""
    global _pm
    with _lock:
        _pm = None


def list_plugins(pm: pluggy.PluginManager | None = None) -> list[PluginInfo]:
    """Registered plugins with their origin, built-ins first."""
    pm = pm or get_plugin_manager()
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    infos = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked
            continue
        dist = dists.get(id(plugin))
        # "builtin" names the group KVPLUGIN_BLOCK_PLUGINS=builtin blocks
        origin = f"{dist.project_name} {dist.version}" if dist else BUILTIN_NAME
        infos.append(PluginInfo(name=name, origin=origin))
    return sorted(infos, key=lambda i: (i.origin != BUILTIN_NAME, i.name))
