"""Fixtures for integration tests: real host servers on 127.0.0.1.

- ``tiny_model`` (session): the tiny random-weight llama built offline into a
  temp dir by :func:`kvplugin.tools.models.tiny.build_tiny_model`.
- ``start_server`` (module): a factory ``start_server(cmd, *extra, env=None,
  model=None, **kwargs) -> ServerProcess`` that picks a free port, starts
  ``cmd(tiny_model, port, *extra)`` and stops every server it started when the
  module ends. ``cmd`` is one of ``harness.mlx_lm_server_cmd``,
  ``harness.mlx_lm_module_cmd``, ``harness.vllm_mlx_serve_cmd``.
- ``harness.server_fixture(cmd, *extra, env=...)`` builds a module-scoped
  fixture in one line, for the common one-server-per-module case.

A missing host fails loudly (``HostNotInstalled``); nothing here skips.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # `import harness` under any --import-mode
    sys.path.insert(0, str(_HERE))
try:
    import kvplugin.tools.models.tiny  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:  # a plain checkout: use the repo's copy
    sys.path.insert(0, str(_HERE.parent))

import harness  # noqa: E402

from kvplugin.tools.models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Directory of the tiny model (built once per test session)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def start_server(tiny_model, tmp_path_factory):
    """Factory: start a server on the tiny model; all are stopped at module end."""
    started: list[harness.ServerProcess] = []

    def start(cmd, *extra, env=None, model=None, model_dir=None, **kwargs):
        if model is None and cmd in (harness.vllm_mlx_serve_cmd, harness.mlx_openai_server_cmd):
            model = harness.SERVED_MODEL_NAME
        port = harness.free_port()
        srv = harness.ServerProcess(
            cmd(model_dir or tiny_model, port, *extra), port=port, env=env, model=model,
            workdir=tmp_path_factory.mktemp(getattr(cmd, "__name__", "server")), **kwargs)
        started.append(srv)
        return srv.start()

    yield start
    for srv in reversed(started):
        srv.stop()


@pytest.fixture
def refusing_plugin(tmp_path) -> dict[str, str]:
    """Env that installs a plugin (a real entry point, on PYTHONPATH) whose
    ``kvplugin_configure`` raises ``SettingsError``: every host must stop at start-up."""
    return harness.plugin_on_path(tmp_path, "refuse", (
        "from kvplugin.hookspecs import hookimpl\n"
        "from kvplugin.settings import SettingsError\n\n"
        "@hookimpl\n"
        "def kvplugin_configure(settings, host):\n"
        "    raise SettingsError(f'kvp-refuse: refusing to serve on {host}')\n"
    ))


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on 127.0.0.1 for the module (fails loudly when not installed)."""
    from kvplugin.tools.redisproc import RedisServer

    with RedisServer() as server:
        yield server
