"""Root pytest configuration: ``--host`` picks which host's integration tests run.

Each tox environment installs one host (and version); integration modules are named
``test_mlx_lm_*`` / ``test_vllm_mlx_*``. Modules of the *selected* host that cannot find
it fail loudly; modules of the other host are deselected, not skipped silently.

``@pytest.mark.host_version("mlx-lm", ">=0.32.0")``: a test of a feature the installed host
version does not have (a flag it lacks, a model family it cannot build) is deselected there,
counted in pytest's summary, never skipped.
"""

from __future__ import annotations

from kvplugin.hostspecs import BUILTIN_HOSTS, KNOWN_HOSTS

# "mlx-lm" -> "test_mlx_lm": from the declared hosts
HOST_PREFIXES = {decl.name: "test_" + decl.name.replace("-", "_") for decl in KNOWN_HOSTS}


def pytest_addoption(parser):
    parser.addoption(
        "--host",
        choices=["all", *HOST_PREFIXES],
        default="all",
        help="run only this host's integration tests (tox sets it per environment)",
    )


def _host_has(item) -> bool:
    """False if a ``host_version`` mark excludes the installed version of that host."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    for mark in item.iter_markers("host_version"):
        host, spec = mark.args
        decl = next(d for d in BUILTIN_HOSTS if d.name == host)
        try:
            installed = version(decl.distribution)
        except PackageNotFoundError:  # the host's own modules fail loudly without it
            continue
        if installed not in SpecifierSet(spec):
            return False
    return True


def pytest_collection_modifyitems(config, items):
    host = config.getoption("--host")
    others = tuple(p for h, p in HOST_PREFIXES.items() if h != host) if host != "all" else ()
    keep, drop = [], []
    for item in items:
        wrong_host = bool(others) and item.path.name.startswith(others)
        (drop if wrong_host or not _host_has(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
