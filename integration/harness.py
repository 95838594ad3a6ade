"""Integration-test face of :mod:`kvplugin.tools.hostproc` plus the pytest glue."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from kvplugin.tools.hostproc import *  # noqa: F403  (the harness API)
from kvplugin.tools.hostproc import (
    SERVED_MODEL_NAME,
    ServerProcess,
    free_port,
    vllm_mlx_serve_cmd,
)

# --------------------------------------------------------------------------- #
# pytest glue


def server_fixture(
    cmd: Callable[..., list[str]],
    *extra: str,
    env: Mapping[str, str | None] | None = None,
    model: str | None = None,
    scope: str = "module",
    **kwargs: Any,
):
    """A pytest fixture that starts ``cmd(tiny_model, free_port(), *extra)``
    once per ``scope`` and stops it afterwards; needs the ``tiny_model``
    fixture (integration/conftest.py). ``model`` defaults to
    :data:`SERVED_MODEL_NAME` for :func:`vllm_mlx_serve_cmd`, else None::

        server = server_fixture(mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"})
    """
    import pytest

    if model is None and cmd is vllm_mlx_serve_cmd:
        model = SERVED_MODEL_NAME

    @pytest.fixture(scope=scope)
    def _server(tiny_model, tmp_path_factory):
        port = free_port()
        srv = ServerProcess(cmd(tiny_model, port, *extra), port=port, env=env, model=model,
                            workdir=tmp_path_factory.mktemp(cmd.__name__), **kwargs)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()

    return _server
