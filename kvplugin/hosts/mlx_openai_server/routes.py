"""kvplugin's numbers on mlx-openai-server's FastAPI app: ``GET /kvplugin/stats`` (the model
process's report as JSON) and ``GET /metrics`` (kvplugin's Prometheus series; the host has
no ``/metrics`` of its own).

Why through the handler proxy: the store lives in the model's spawned process; the server
process asks it the way it asks for everything else, ``HandlerProcessProxy._call(method)``,
which runs the method kvplugin added to the model process's handler. With several models
(``--config``), these describe the first one the host serves by default.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' parameter types.

import json
from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import STATS_PATH, wraps_original

__all__ = ["add_routes", "wrap_setup_server"]


def wrap_setup_server(original: Callable, server: Any) -> Callable:
    """``app.server.setup_server``: the app it builds gets kvplugin's two routes."""

    @wraps_original(original)
    def setup_server(config_args: Any) -> Any:
        config = original(config_args)
        app = getattr(config, "app", None)
        if not hasattr(app, "add_api_route"):
            app = getattr(server, "app", None)
        add_routes(app)
        return config

    return setup_server


def add_routes(app: Any) -> None:
    from fastapi import Request, Response

    from kvplugin.metrics import CONTENT_TYPE, METRICS_PATH, exposition

    def model_handler(request: Request) -> Any:
        return getattr(request.app.state, "handler", None)

    async def kvplugin_stats(request: Request) -> Any:
        handler = model_handler(request)
        report = ({"host": "mlx-openai-server", "active": False} if handler is None
                  else await handler._call("kvplugin_report"))
        return Response(json.dumps(report, default=str), media_type="application/json")

    async def kvplugin_metrics(request: Request) -> Any:
        handler = model_handler(request)
        if handler is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(exposition(await handler._call("kvplugin_stats")),
                        media_type=CONTENT_TYPE)

    app.add_api_route(STATS_PATH, kvplugin_stats, methods=["GET"], include_in_schema=False)
    app.add_api_route(METRICS_PATH, kvplugin_metrics, methods=["GET"], include_in_schema=False)
