"""How a host server is launched: its command line and its sealed environment.

Stdlib only (plus kvplugin's stdlib-only host declarations, :mod:`kvplugin.hostspecs`, which
say how each host is launched), so that the launch facts live apart from the process that
runs them (:mod:`kvplugin.tools.hostproc`).

Every child gets a scratch ``HOME`` (plus ``HF_HOME`` under it, ``XDG_*`` unset) and
``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` (:func:`server_env`), so nothing is
downloaded and nothing persists into the real home (vllm-mlx writes its prefix cache under
``~/.cache/vllm-mlx``).

Model ids: ``mlx_lm.server`` accepts a request without ``"model"`` (its default model),
``"default_model"`` or the exact ``--model`` path; any other id is treated as a Hugging Face
repo to load (and fails offline). ``vllm-mlx serve`` answers 404 unless ``"model"`` is the
``--served-model-name`` (or the path). The ``*_cmd`` helpers below say which to use.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Mapping

from kvplugin.hostspecs import MLX_LM, MLX_OPENAI_SERVER, VLLM_MLX, HostDeclaration

__all__ = [
    "HOST",
    "SERVED_MODEL_NAME",
    "HostNotInstalled",
    "free_port",
    "venv_script",
    "host_version",
    "server_env",
    "host_cmd",
    "module_cmd",
    "mlx_lm_server_cmd",
    "mlx_lm_module_cmd",
    "vllm_mlx_serve_cmd",
    "mlx_openai_server_cmd",
]

HOST = "127.0.0.1"
SERVED_MODEL_NAME = "tinyllama"  # == kvplugin.tools.models.tiny.SERVED_MODEL_NAME
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
# Variables that would point a child at the real home's caches.
_DROP_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE",
             "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")


class HostNotInstalled(RuntimeError):
    """A host server this test needs is not installed in this interpreter's env."""


def free_port(host: str = HOST) -> int:
    """A TCP port that is free on ``host`` right now (bind to 0, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def venv_script(name: str) -> Path:
    """Path of console script ``name`` next to ``sys.executable``; raises
    :class:`HostNotInstalled` if it is missing."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise HostNotInstalled(
            f"{name!r} not found next to {sys.executable} ({path}); install the host "
            f"into this environment (see tox.ini) — integration tests never skip a host"
        )
    return path


def host_version(distribution: str) -> str:
    """Installed version of ``distribution`` (e.g. ``"mlx-lm"``, ``"vllm-mlx"``);
    raises :class:`HostNotInstalled`."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise HostNotInstalled(
            f"distribution {distribution!r} is not installed for {sys.executable}"
        ) from None


def server_env(home: Path | str, env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """``os.environ`` + offline flags + scratch ``HOME`` (``HF_HOME`` under it,
    with an empty hub cache so mlx-lm's ``/v1/models`` doesn't log a traceback),
    then ``env`` (a ``None`` value removes the variable)."""
    home = Path(home)
    hf_home = home / ".cache" / "huggingface"
    (hf_home / "hub").mkdir(parents=True, exist_ok=True)
    out = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    out.update(OFFLINE_ENV)
    out["HOME"] = str(home)
    out["HF_HOME"] = str(hf_home)
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = str(v)
    return out


def host_cmd(decl: HostDeclaration, model_dir: Path | str, port: int, *extra: str,
             served_model_name: str = SERVED_MODEL_NAME) -> list[str]:
    """``<venv>/bin/<console script> <declared launch args> *extra`` for a declared host
    (:mod:`kvplugin.hostspecs`): the one place a launch command line is put together."""
    fill = {"model": str(model_dir), "host": HOST, "port": str(port),
            "served_model_name": served_model_name}
    return [str(venv_script(decl.console_script)), *(a.format(**fill) for a in decl.launch),
            *map(str, extra)]


def mlx_lm_server_cmd(model_dir: Path | str, port: int, *extra: str) -> list[str]:
    """``<venv>/bin/mlx_lm.server --model DIR --host 127.0.0.1 --port P *extra``.
    Send requests without ``model`` (the harness default)."""
    return host_cmd(MLX_LM, model_dir, port, *extra)


def module_cmd(decl: HostDeclaration, model_dir: Path | str, port: int, *extra: str) -> list[str]:
    """``python -m <declared module launch> <declared launch args> *extra``, for a host
    whose console script is missing; raises :class:`HostNotInstalled` if the host is."""
    if decl.module_launch is None:
        raise ValueError(f"{decl.name} has no `python -m` form")
    host_version(decl.distribution)
    fill = {"model": str(model_dir), "host": HOST, "port": str(port),
            "served_model_name": SERVED_MODEL_NAME}
    return [sys.executable, "-m", *decl.module_launch,
            *(a.format(**fill) for a in decl.launch), *map(str, extra)]


def mlx_lm_module_cmd(model_dir: Path | str, port: int, *extra: str) -> list[str]:
    """``python -m mlx_lm server --model DIR ...`` (imports ``mlx_lm.server`` as a
    module, like the console script; ``python -m mlx_lm.server`` would run it as
    ``__main__`` and is not offered)."""
    return module_cmd(MLX_LM, model_dir, port, *extra)


def vllm_mlx_serve_cmd(
    model_dir: Path | str, port: int, *extra: str, served_model_name: str = SERVED_MODEL_NAME
) -> list[str]:
    """``<venv>/bin/vllm-mlx serve DIR --host 127.0.0.1 --port P --offline
    --served-model-name tinyllama *extra``. Send ``model=SERVED_MODEL_NAME``."""
    return host_cmd(VLLM_MLX, model_dir, port, *extra, served_model_name=served_model_name)


def mlx_openai_server_cmd(
    model_dir: Path | str, port: int, *extra: str, served_model_name: str = SERVED_MODEL_NAME
) -> list[str]:
    """``<venv>/bin/mlx-openai-server launch --model-path DIR --model-type lm --host 127.0.0.1
    --port P --served-model-name tinyllama --no-log-file *extra``. Send
    ``model=SERVED_MODEL_NAME``."""
    return host_cmd(MLX_OPENAI_SERVER, model_dir, port, *extra,
                    served_model_name=served_model_name)
