"""The plugin manager: kvplugin's built-ins plus third-party plugins from entry points.

Third parties register a module or object under the ``kvplugin`` entry-point group::

    [project.entry-points.kvplugin]
    myquant = "myquant.plugin"

Entry points are loaded once per process. ``KVPLUGIN_BLOCK_PLUGINS=name,name`` blocks
plugins by entry-point name (``builtin`` blocks kvplugin's own strategies, which is
mainly useful for tests of a replacement plugin).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import pluggy

from kvplugin import hookspecs

BUILTIN_NAME = "builtin"
BLOCK_ENV = "KVPLUGIN_BLOCK_PLUGINS"

_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None


@dataclass(frozen=True)
class PluginInfo:
    name: str
    origin: str  # "built-in" or "<distribution> <version>"


def _blocked_names() -> list[str]:
    return [n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()]


def create_plugin_manager(*, load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the hook specs, the built-ins and (optionally) entry points."""
    from kvplugin.cache import builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in _blocked_names():
        pm.set_blocked(name)
    pm.register(builtin, name=BUILTIN_NAME)
    if load_entry_points:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
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
        origin = f"{dist.project_name} {dist.version}" if dist else "built-in"
        infos.append(PluginInfo(name=name, origin=origin))
    return sorted(infos, key=lambda i: (i.origin != "built-in", i.name))
