"""kvplugin's numbers on ``mlx_lm.server``'s HTTP surface: ``GET /kvplugin/stats`` (the
service's report as JSON) and ``GET /metrics`` (kvplugin's Prometheus series; mlx-lm has no
``/metrics`` of its own).

Why through ``APIHandler.do_GET``: mlx-lm routes by path inside that one method; every other
path goes to it unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import STATS_PATH, PatchRegistry, wraps_original
from kvplugin.hosts.mlx_lm.prompt_cache import KVPluginPromptCache

__all__ = ["install_routes"]


def install_routes(patches: PatchRegistry, handler_cls: Any) -> None:
    """Wrap ``handler_cls.do_GET`` (``mlx_lm.server.APIHandler``)."""
    patches.replace(handler_cls, "do_GET", wrap_do_get(handler_cls.do_GET))


def wrap_do_get(original: Callable) -> Callable:
    from kvplugin.metrics import CONTENT_TYPE, METRICS_PATH

    @wraps_original(original)
    def do_GET(handler, *args: Any, **kwargs: Any) -> Any:
        path = handler.path.split("?", 1)[0].rstrip("/")
        if path not in (STATS_PATH, METRICS_PATH):
            return original(handler, *args, **kwargs)
        generator = getattr(handler, "response_generator", None)
        cache = getattr(generator, "prompt_cache", None)
        if not isinstance(cache, KVPluginPromptCache):
            return original(handler, *args, **kwargs)
        try:
            if path == METRICS_PATH:  # mlx-lm has no /metrics: kvplugin's series only
                from kvplugin.metrics import exposition

                status, data, kind = 200, exposition(cache.service.stats()), CONTENT_TYPE
            else:
                body = cache.report()
                status, kind = 200, "application/json"
                data = json.dumps(body, default=str).encode()
        except Exception as exc:
            status, kind = 500, "application/json"
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        handler.send_response(status)
        handler.send_header("Content-type", kind)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
        handler.wfile.flush()

    return do_GET
