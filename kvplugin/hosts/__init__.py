"""The only code that touches host internals: one module per host.

Importing this package (or an adapter module) imports no host and no mlx; host modules
are imported by the adapters' ``apply`` only, after the host itself imported them.

Adapters are found through the ``kvplugin.hosts`` entry-point group (pyproject lists the
built-in ones), so a third host can ship as its own plugin. The built-in adapters are also
known from :mod:`kvplugin.hostspecs` itself, so a source checkout whose installed metadata
is older than its code still finds them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvplugin.hostspecs import KNOWN_HOSTS

if TYPE_CHECKING:
    from kvplugin.hosts.base import HostAdapter

ENTRY_POINT_GROUP = "kvplugin.hosts"


def adapter_paths() -> dict[str, str]:
    """Host name -> ``"module:attribute"`` of its adapter: the entry points, in the order
    found, then any built-in or recognized host the installed metadata does not list."""
    from importlib.metadata import entry_points

    found: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    for decl in KNOWN_HOSTS:
        found.setdefault(decl.name, decl.adapter)
    return found


def _load(path: str) -> HostAdapter:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def get_adapter(name: str) -> HostAdapter:
    paths = adapter_paths()
    if name not in paths:
        raise KeyError(f"no kvplugin host adapter {name!r} (known: {', '.join(paths)})")
    return _load(paths[name])


def all_adapters() -> list[HostAdapter]:
    return [_load(path) for path in adapter_paths().values()]
