"""Root pytest configuration: ``--host`` picks which host's integration tests run.

Each tox environment installs one host (and version); integration modules are named
``test_mlx_lm_*`` / ``test_vllm_mlx_*``. Modules of the *selected* host that cannot find
it fail loudly; modules of the other host are deselected, not skipped silently.
"""

from __future__ import annotations

from kvplugin.hostspecs import BUILTIN_HOSTS

# "mlx-lm" -> "test_mlx_lm": from the declared hosts
HOST_PREFIXES = {decl.name: "test_" + decl.name.replace("-", "_") for decl in BUILTIN_HOSTS}


def pytest_addoption(parser):
    parser.addoption(
        "--host",
        choices=["all", *HOST_PREFIXES],
        default="all",
        help="run only this host's integration tests (tox sets it per environment)",
    )


def pytest_collection_modifyitems(config, items):
    host = config.getoption("--host")
    if host == "all":
        return
    others = tuple(p for h, p in HOST_PREFIXES.items() if h != host)
    keep, drop = [], []
    for item in items:
        (drop if item.path.name.startswith(others) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
