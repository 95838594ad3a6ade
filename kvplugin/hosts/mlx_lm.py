"""mlx-lm adapter: the seams of ``mlx_lm.server`` and ``mlx_lm.models.cache``."""

from __future__ import annotations

from typing import Any

from packaging.specifiers import SpecifierSet

from kvplugin.hosts.base import HostAdapter, PatchRegistry


class MlxLmAdapter(HostAdapter):
    name = "mlx-lm"
    distribution = "mlx-lm"
    supported = SpecifierSet(">=0.31.3,<0.33")
    trigger_module = "mlx_lm.server"

    def apply(self, module: Any, patches: PatchRegistry) -> None:
        raise NotImplementedError("the mlx-lm adapter is not implemented yet")


ADAPTER = MlxLmAdapter()


def on_import(module: Any) -> None:
    ADAPTER.install(module)
