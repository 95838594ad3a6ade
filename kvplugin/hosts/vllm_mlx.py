"""vllm-mlx adapter: the seams of ``vllm_mlx.cli``, the scheduler and ``memory_cache``."""

from __future__ import annotations

from typing import Any

from packaging.specifiers import SpecifierSet

from kvplugin.hosts.base import HostAdapter, PatchRegistry


class VllmMlxAdapter(HostAdapter):
    name = "vllm-mlx"
    distribution = "vllm-mlx"
    supported = SpecifierSet(">=0.5.0,<0.7")
    trigger_module = "vllm_mlx.cli"

    def apply(self, module: Any, patches: PatchRegistry) -> None:
        raise NotImplementedError("the vllm-mlx adapter is not implemented yet")


ADAPTER = VllmMlxAdapter()


def on_import(module: Any) -> None:
    ADAPTER.install(module)
