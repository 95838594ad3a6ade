"""Hosts kvplugin recognizes and never patches (:data:`kvplugin.hostspecs.UNSUPPORTED_HOSTS`).

Why an adapter that patches nothing: a server that imports kvplugin's trigger and hears
nothing from it looks like kvplugin working. Each such host says, once per process,
``kvplugin: <host> <version> is not supported; the server runs stock``, and ``kvplugin
info`` lists it with the supported range ``none``. Nothing of the host is touched: no flag
is added, no setting is read, no module is replaced.
"""

from __future__ import annotations

from typing import Any

from kvplugin.hosts.base import HostAdapter
from kvplugin.hostspecs import UNSUPPORTED_HOSTS, UnsupportedHost
from kvplugin.log import say


class NoVersion:
    """The supported range of a host kvplugin never patches: it contains no version."""

    def __contains__(self, version: object) -> bool:
        return False

    def __str__(self) -> str:
        return "none"


class UnsupportedHostAdapter(HostAdapter):
    """Says the one start-up line for a recognized host and leaves it stock."""

    def __init__(self, decl: UnsupportedHost) -> None:
        super().__init__()
        self.name = decl.name
        self.distribution = decl.distribution
        self.trigger_module = decl.trigger_module
        self.supported = NoVersion()

    def support_problem(self, module: Any = None) -> str:
        version = self.version()
        return f"{self.distribution} {version or '(version unknown)'} is not supported"

    def install(self, module: Any) -> bool:
        say(f"{self.support_problem()}; the server runs stock", key=f"unsupported:{self.name}")
        return False


#: declared name -> adapter; each is also a module attribute, the path hostspecs names
ADAPTERS: dict[str, UnsupportedHostAdapter] = {
    decl.name: UnsupportedHostAdapter(decl) for decl in UNSUPPORTED_HOSTS}
RAPID_MLX = ADAPTERS["rapid-mlx"]


def adapter_for(distribution: str) -> UnsupportedHostAdapter | None:
    """The adapter of the recognized host shipped as ``distribution`` (None: not one)."""
    return next((a for a in ADAPTERS.values() if a.distribution == distribution), None)


def on_import(module: Any) -> None:
    """The bootstrap's call when a recognized host's trigger module has been imported."""
    for adapter in ADAPTERS.values():
        if adapter.trigger_module == getattr(module, "__name__", None):
            adapter.install(module)


__all__ = ["ADAPTERS", "RAPID_MLX", "NoVersion", "UnsupportedHostAdapter", "adapter_for",
           "on_import"]
