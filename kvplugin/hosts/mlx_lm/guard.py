"""The generation thread of ``mlx_lm.server`` survives an error in its loop.

Why: mlx-lm runs every request in one generation thread. Its sequential path catches a
request's error and hands it to that request, but its batched path does not: an exception
from ``BatchGenerator.next`` (e.g. a reused cache that cannot be merged into the batch)
escapes ``_generate``, the thread dies, and the process answers 503 until restarted. kvplugin
checks every cold entry before it is handed over (:mod:`kvplugin.cache.service.fit`); this is
the last line: whatever still goes wrong costs the requests in flight an error, never the
server.

How: ``_next_request`` is wrapped to remember each request's response queue (weakly: a
finished request's queue goes away with its handler). When ``_generate`` raises, every
remembered queue gets the error (mlx-lm's handler raises it to its client; a finished
request's handler no longer reads), and ``_generate`` runs again (the model stays loaded,
the prompt cache is kept). Five failures within a minute: the loop is left to die as stock.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from kvplugin.hosts.base import PatchRegistry, wraps_original
from kvplugin.log import say

__all__ = ["guard_generation"]

_MAX_FAILURES = 5
_WINDOW_S = 60.0


def guard_generation(patches: PatchRegistry, cls: Any) -> None:
    """Wrap ``cls._generate`` and ``cls._next_request`` (``mlx_lm.server.ResponseGenerator``)."""
    original_next = cls._next_request
    original_generate = cls._generate

    @wraps_original(original_next)
    def _next_request(self, *args: Any, **kwargs: Any) -> Any:
        request = original_next(self, *args, **kwargs)
        if isinstance(request, tuple) and request:
            try:
                _in_flight(self).add(request[0])
            except TypeError:  # not weak-referenceable: not tracked
                pass
        return request

    @wraps_original(original_generate)
    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        failures: list[float] = []
        while True:
            try:
                return original_generate(self, *args, **kwargs)
            except Exception as exc:
                now = time.monotonic()
                failures = [t for t in failures if now - t < _WINDOW_S] + [now]
                if getattr(self, "_stop", False) or len(failures) > _MAX_FAILURES:
                    raise
                queues = list(_in_flight(self))
                _in_flight(self).clear()
                error = RuntimeError(f"generation failed: {type(exc).__name__}: {exc}")
                for q in queues:
                    q.put(error)
                say(f"mlx-lm's generation loop failed ({type(exc).__name__}: {exc}); "
                    f"{len(queues)} request(s) in flight got an error, the server goes on",
                    key=f"mlx-lm:generate-failed:{type(exc).__name__}")

    patches.replace(cls, "_next_request", _next_request)
    patches.replace(cls, "_generate", _generate)


def _in_flight(generator: Any) -> weakref.WeakSet:
    queues = generator.__dict__.get("_kvplugin_in_flight")
    if queues is None:
        queues = generator.__dict__["_kvplugin_in_flight"] = weakref.WeakSet()
    return queues
