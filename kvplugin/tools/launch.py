"""Launch specs of the hosts the tools can start, derived from their declarations.

``kvplugin demo`` and ``kvplugin bench --server`` start a host on the tiny local model.
Which command, which request ``model``, which environment, which budget flags and how to
install it all come from :mod:`kvplugin.hostspecs`; this module adds the checks a user
needs before a run (installed? inside the supported range?) and builds the tiny model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from kvplugin.hostspecs import BUILTIN_HOSTS, HostDeclaration, declaration
from kvplugin.tools import hostcmd
from kvplugin.tools.console import Status, say
from kvplugin.tools.hostcmd import HostNotInstalled

__all__ = ["HOSTS", "INSTALL_HINT", "DemoFailed", "HostSpec", "host_spec", "prepare_model"]

HOSTS = tuple(decl.name for decl in BUILTIN_HOSTS)
INSTALL_HINT = {decl.name: decl.install for decl in BUILTIN_HOSTS}


class DemoFailed(RuntimeError):
    """The demo cannot show kvplugin working; the message says why (exit code 1)."""


@dataclass(frozen=True)
class HostSpec:
    """How to launch one host on the tiny model and talk to it."""

    decl: HostDeclaration

    @property
    def name(self) -> str:  # "mlx-lm" / "vllm-mlx"
        return self.decl.name

    @property
    def distribution(self) -> str:
        return self.decl.distribution

    @property
    def script(self) -> str:  # console script next to sys.executable
        return self.decl.console_script

    @property
    def model(self) -> str | None:
        """The request's "model" (None: the server's default model)."""
        return hostcmd.SERVED_MODEL_NAME if self.decl.request_needs_model else None

    @property
    def env(self) -> Mapping[str, str]:
        return self.decl.launch_env

    @property
    def label(self) -> str:
        return self.decl.label

    def version(self) -> str:
        """Installed version; :class:`HostNotInstalled` with an install hint if missing."""
        try:
            return hostcmd.host_version(self.distribution)
        except HostNotInstalled:
            raise HostNotInstalled(
                f"{self.name} is not installed in this environment ({sys.executable}). "
                f"Install it with: {INSTALL_HINT[self.name]}"
            ) from None

    def check(self) -> str:
        """Version of an installed host that kvplugin supports; raises otherwise."""
        version = self.version()
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        supported = SpecifierSet(self.decl.supported)
        try:
            ok = Version(version) in supported
        except InvalidVersion:
            ok = False
        if not ok:
            raise DemoFailed(
                f"{self.name} {version} is installed, but kvplugin supports {self.name} "
                f"{supported} only: the server would run stock. Install a supported version, "
                f"e.g. {INSTALL_HINT[self.name]}"
            )
        return version

    def command(self, model_dir: Path | str, port: int, extra: Sequence[str] = ()) -> list[str]:
        """The console script's command line, or ``python -m`` where the host has such a
        form and its script is missing."""
        script = Path(sys.executable).parent / self.script
        if script.is_file():
            return hostcmd.host_cmd(self.decl, model_dir, port, *extra)
        if self.decl.module_launch is not None:
            return hostcmd.module_cmd(self.decl, model_dir, port, *extra)
        raise HostNotInstalled(
            f"the {self.script} command is not next to {sys.executable}; install {self.name} "
            f"into this environment: {INSTALL_HINT[self.name]}")

    def budget_args(self, nbytes: int) -> list[str]:
        """Host flags for a prompt-cache byte budget (and no small entry-count limit)."""
        fill = {"bytes": str(int(nbytes)), "mb": str(max(1, round(nbytes / 1e6)))}
        return [a.format(**fill) for a in self.decl.budget_args]


def host_spec(name: str) -> HostSpec:
    return HostSpec(declaration(name))


def prepare_model(model_dir: Path | None, *, rebuild: bool = False, progress: bool = True) -> Path:
    """The tiny model's directory: reused when complete, else built (once) with a status line."""
    from kvplugin.tools.models.tiny import build_tiny_model, default_model_dir, is_complete

    target = Path(model_dir).expanduser() if model_dir is not None else default_model_dir()
    if not rebuild and is_complete(target, seed=0):
        if progress:
            say(f"using the tiny model in {target}")
        return target.resolve()
    with Status(f"building the tiny model (once) in {target}", enabled=progress):
        try:
            import mlx_lm  # noqa: F401  (the model is built with mlx-lm's llama)
        except ImportError:
            raise HostNotInstalled(
                f"building the tiny model needs mlx-lm; install it with {INSTALL_HINT['mlx-lm']}"
            ) from None
        return build_tiny_model(target, force=rebuild)
