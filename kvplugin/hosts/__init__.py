"""The only code that touches host internals: one module per host.

Importing this package (or an adapter module) imports no host and no mlx; host modules
are imported by the adapters' ``apply`` only, after the host itself imported them.
"""

from __future__ import annotations

import importlib

from kvplugin.hosts.base import HostAdapter

# adapter name -> "module:attribute" of its singleton
ADAPTERS: dict[str, str] = {
    "mlx-lm": "kvplugin.hosts.mlx_lm:ADAPTER",
    "vllm-mlx": "kvplugin.hosts.vllm_mlx:ADAPTER",
}


def get_adapter(name: str) -> HostAdapter:
    module, _, attr = ADAPTERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def all_adapters() -> list[HostAdapter]:
    return [get_adapter(name) for name in ADAPTERS]
