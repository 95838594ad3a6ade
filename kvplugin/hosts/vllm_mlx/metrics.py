"""kvplugin's numbers on vllm-mlx's HTTP surface: ``/metrics`` and ``GET /kvplugin/stats``.

* A Prometheus collector with kvplugin's counters is registered on the host's ``/metrics``
  registry (``--enable-metrics``) when vllm-mlx initialises it (``MetricsCollector.
  _init_prometheus``), and unregistered again on uninstall.
* ``GET /kvplugin/stats`` returns the session's report (counters plus stored entries, the
  shape every host serves) with ``host_version`` and ``mode``.

Both read the session from the adapter's runtime at request time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import STATS_PATH, PatchRegistry, require_attrs, wraps_original
from kvplugin.log import say
from kvplugin.metrics import COUNTERS, GAUGES, KVCollector, families  # noqa: F401  (shared)


def _stats(adapter: Any) -> dict | None:
    """The running session's stats at scrape time (None before it exists)."""
    service = adapter.runtime.service
    return service.stats() if service is not None else None

def check_seams(metrics: Any, server: Any) -> None:
    """Fail closed: the metrics initialiser and a mutable route list exist."""
    require_attrs(metrics, "MetricsCollector")
    require_attrs(metrics.MetricsCollector, "_init_prometheus")
    require_attrs(server, "app")
    router = getattr(server.app, "router", None)
    if not isinstance(getattr(router, "routes", None), list) or "routes" not in vars(router):
        raise TypeError("vllm_mlx.server.app.router.routes is not a list")


def install(patches: PatchRegistry, adapter: Any, metrics: Any, server: Any) -> None:
    """Patch ``/metrics`` registration and add the stats route (after :func:`check_seams`)."""
    mc = metrics.MetricsCollector
    patches.replace(mc, "_init_prometheus", wrap_init_prometheus(mc._init_prometheus, adapter))
    register_collector(getattr(metrics, "metrics", None), adapter)  # already initialised (rare)
    router = server.app.router
    patches.replace(router, "routes", [*router.routes, stats_route(adapter)])


def register_collector(collector_owner: Any, adapter: Any) -> None:
    """Register one :class:`KVCollector` on the owner's registry (once per registry)."""
    prom = getattr(collector_owner, "_prom", None)
    if not isinstance(prom, dict) or "registry" not in prom:
        return
    registry = prom["registry"]
    rt = adapter.runtime
    if any(reg is registry for reg, _ in rt.collectors):
        return
    collector = KVCollector(lambda: _stats(adapter))
    registry.register(collector)
    rt.collectors.append((registry, collector))


def unregister_collectors(runtime: Any) -> None:
    """Take every collector this runtime registered off its registry (uninstall)."""
    while runtime.collectors:
        registry, collector = runtime.collectors.pop()
        try:
            registry.unregister(collector)
        except Exception:  # already gone (the host replaced its registry)
            pass


def wrap_init_prometheus(original: Callable, adapter: Any) -> Callable:
    @wraps_original(original)
    def _init_prometheus(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            register_collector(self, adapter)
        except Exception as exc:
            say(f"kvplugin counters not on /metrics ({type(exc).__name__}: {exc})", key="metrics")
        return result

    return _init_prometheus


def stats_handler(adapter: Any) -> Callable[[], Any]:
    """The coroutine that answers ``GET /kvplugin/stats`` (kept apart from FastAPI so it can
    be exercised without it)."""

    async def kvplugin_stats() -> dict:
        service = adapter.runtime.service
        if service is None:
            return {"host": "vllm-mlx", "active": False}
        return adapter.stats_report(service)

    return kvplugin_stats


def stats_route(adapter: Any) -> Any:
    """A FastAPI route for ``GET /kvplugin/stats`` (hidden from the host's OpenAPI schema)."""
    from fastapi import APIRouter

    router = APIRouter()
    router.add_api_route(STATS_PATH, stats_handler(adapter), methods=["GET"],
                         include_in_schema=False)
    return router.routes[0]
