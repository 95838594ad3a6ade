"""Make MLX's float32 matmuls fast on a Linux CPU: OpenBLAS via ``LD_PRELOAD``.

WHY: the Linux CPU build of MLX resolves its BLAS calls to whatever ``libblas.so.3`` the
dynamic linker finds first; without OpenBLAS that is a slow reference implementation, and a
real model (SmolLM2-135M) then takes about a minute per forward pass over a few hundred
tokens instead of about a second. Preloading Debian's pthread OpenBLAS gives the same
answers, much faster. A preload only works when a process starts, so this module hands
out the environment for child processes (servers, benchmark workers); it changes nothing
in the current one.

On macOS MLX runs on Metal (and Accelerate), so no preload is needed there.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import Mapping

__all__ = ["OpenBLASMissing", "INSTALL_HINT", "openblas_path", "preload_env"]

INSTALL_HINT = "apt-get install libopenblas0-pthread"
_LIB_DIRS = ("/usr/lib/{triplet}/openblas-pthread", "/usr/lib64/openblas-pthread")
_LIB_NAMES = ("libblas.so.3", "libopenblas.so.0")


class OpenBLASMissing(RuntimeError):
    """No pthread OpenBLAS library to preload on this Linux machine."""


def _triplet() -> str:
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        return str(multiarch)
    return f"{os.uname().machine}-linux-gnu"


def openblas_path() -> Path | None:
    """Debian/Ubuntu's pthread OpenBLAS (``libblas.so.3`` of ``libopenblas0-pthread``),
    or None when it is not installed. ``KVPLUGIN_OPENBLAS`` names another file."""
    override = os.environ.get("KVPLUGIN_OPENBLAS")
    if override:
        return Path(override) if Path(override).is_file() else None
    for folder in _LIB_DIRS:
        for name in _LIB_NAMES:
            path = Path(folder.format(triplet=_triplet())) / name
            if path.is_file():
                return path
    return None


def preload_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to add to a child's environment so its MLX uses OpenBLAS: ``{}`` on
    macOS, ``{"LD_PRELOAD": ...}`` on Linux (an existing ``LD_PRELOAD`` in ``env``, else
    in ``os.environ``, is kept after it). Raises :class:`OpenBLASMissing` on Linux
    without OpenBLAS, naming the package to install."""
    if sys.platform == "darwin":
        return {}
    path = openblas_path()
    if path is None:
        raise OpenBLASMissing(
            f"OpenBLAS not found (looked in {', '.join(_LIB_DIRS)}); MLX's float32 matmuls "
            f"on this CPU are far too slow without it. Install it: {INSTALL_HINT}")
    current = (env if env is not None else os.environ).get("LD_PRELOAD", "")
    parts = [str(path), *(p for p in current.split(":") if p and p != str(path))]
    return {"LD_PRELOAD": ":".join(parts)}


def rerun_preloaded(module: str, argv: list[str] | None) -> int | None:
    """On Linux without OpenBLAS preloaded, run ``python -m module argv`` again with it (the
    preload must be in place before MLX loads) and return its exit code; None: already
    preloaded, or not Linux, so the caller goes on."""
    if not sys.platform.startswith("linux") or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return None
    import subprocess

    cmd = [sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)]
    return subprocess.call(cmd, env={**os.environ, **preload_env()})

