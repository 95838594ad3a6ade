"""vllm-mlx seams of a request's ``cache_salt``: carry it from the request to the prompt cache.

What the salt means is the session's (:meth:`KVService.request_salt`,
:meth:`KVService.salted_key`); this module only finds which request a prompt-cache call is for.
vllm-mlx's request models drop fields they do not know, so the salt is read from the body:

``server.app`` (an ASGI middleware, outermost)
    The JSON body of a generation request (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/responses``, ``/v1/messages``) gives the salt; a bad one, or none under
    ``--kv-cache-require-salt``, is answered 400 (``{"detail": ...}``, as vllm-mlx answers a
    bad request). The salt is :data:`REQUEST_SALT` for the rest of the request.
``SimpleEngine._submit_to_generation_worker`` (default mode)
    Wrapped: every step a request runs on the generation thread runs with its salt.
``vllm_mlx.request.Request.__init__`` / ``Scheduler.add_request`` (``--continuous-batching``)
    Wrapped: a request is stamped with its salt when it is made (in the request's task), and
    the prefix-cache lookup in ``add_request`` runs with it. A store names no request, so
    :func:`owner_salt` finds its owner among the scheduler's requests.
"""

from __future__ import annotations

import contextvars
import json
import weakref
from collections.abc import Sequence
from typing import Any

from kvplugin.hosts.base import require_attrs, wraps_original

__all__ = ["GENERATION_PATHS", "REQUEST_SALT", "UNKNOWN", "SaltMiddleware", "check_seams",
           "install", "owner_salt", "request_salt"]

#: The salt of the request being served here (None: it has none, or no request is).
REQUEST_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvplugin_request_salt", default=None)
#: The salt of a store whose request cannot be told.
UNKNOWN = object()
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                              "/v1/messages"})
_ATTR = "_kvplugin_salt"  # on vllm-mlx's Request


def request_salt() -> str | None:
    """The salt of the request this code runs for."""
    return REQUEST_SALT.get()


class SaltMiddleware:
    """Reads a generation request's ``cache_salt`` (pure ASGI: the body is replayed as is)."""

    def __init__(self, app: Any, adapter: Any) -> None:
        self.app = app
        self.adapter = adapter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        service = self.adapter.runtime.service
        if (service is None or scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path") not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            if message.get("type") != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None  # not JSON: the host answers it
        from kvplugin.cache.service.salt import SaltRefused

        try:
            salt = service.request_salt(data)
        except SaltRefused as exc:
            await _reply(send, 400, {"detail": str(exc)})
            return

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        token = REQUEST_SALT.set(salt)
        try:
            await self.app(scope, replay, send)
        finally:
            REQUEST_SALT.reset(token)


async def _reply(send: Any, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def check_seams(server: Any, simple: Any, request_mod: Any, scheduler: Any) -> None:
    """Fail closed: the app takes middleware still, and every wrapped method exists."""
    require_attrs(server, "app")
    app = server.app
    if not isinstance(getattr(app, "user_middleware", None), list):
        raise TypeError("vllm_mlx.server.app.user_middleware is not a list")
    if getattr(app, "middleware_stack", None) is not None:
        raise TypeError("vllm_mlx.server.app has started: no middleware can be added")
    require_attrs(simple.SimpleEngine, "_submit_to_generation_worker")
    require_attrs(request_mod, "Request")
    require_attrs(scheduler.Scheduler, "add_request")


def install(patches: Any, adapter: Any, server: Any, simple: Any, request_mod: Any,
            scheduler: Any) -> None:
    """Patch the seams above (after :func:`check_seams`)."""
    app = server.app
    patches.replace(app, "user_middleware", [middleware(adapter), *app.user_middleware])
    se = simple.SimpleEngine
    patches.replace(se, "_submit_to_generation_worker",
                    _wrap_submit(se._submit_to_generation_worker))
    req = request_mod.Request
    patches.replace(req, "__init__", _wrap_request_init(vars(req)["__init__"]))
    sched = scheduler.Scheduler
    patches.replace(sched, "add_request", _wrap_add_request(sched.add_request))


def middleware(adapter: Any) -> Any:
    """Starlette's record of :class:`SaltMiddleware` (the outermost: added first)."""
    from starlette.middleware import Middleware  # vllm-mlx's dependency, not mlx-lm's

    return Middleware(SaltMiddleware, adapter=adapter)


def _wrap_submit(original: Any) -> Any:
    @wraps_original(original)
    async def _submit_to_generation_worker(self, worker, fn, *args: Any, **kwargs: Any) -> Any:
        salt = REQUEST_SALT.get()

        def with_salt(*a: Any) -> Any:  # on the generation thread
            token = REQUEST_SALT.set(salt)
            try:
                return fn(*a)
            finally:
                REQUEST_SALT.reset(token)

        return await original(self, worker, with_salt, *args, **kwargs)

    return _submit_to_generation_worker


def _wrap_request_init(original: Any) -> Any:
    @wraps_original(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        setattr(self, _ATTR, REQUEST_SALT.get())

    return __init__


def _wrap_add_request(original: Any) -> Any:
    @wraps_original(original)
    def add_request(self, request, *args: Any, **kwargs: Any) -> Any:
        cache = getattr(self, "memory_aware_cache", None)
        if getattr(cache, "kvplugin", False):
            cache._scheduler = weakref.ref(self)  # for owner_salt
        token = REQUEST_SALT.set(getattr(request, _ATTR, None))
        try:
            return original(self, request, *args, **kwargs)
        finally:
            REQUEST_SALT.reset(token)

    return add_request


def owner_salt(scheduler: Any, tokens: Sequence[int], cache: Any) -> Any:
    """The salt of the request a batched store (``tokens`` holding ``cache``) is for.

    The scheduler still holds that request: the one whose extracted cache this is, else the
    requests whose tokens so far start with ``tokens``. Several salts among them (two
    tenants sent the same text at once): :data:`UNKNOWN`, and the store is skipped.
    """
    requests = list(getattr(scheduler, "requests", {}).values()) if scheduler else []
    if all(getattr(r, _ATTR, None) is None for r in requests):
        return None  # no salted request in flight: every store is a saltless one
    for r in requests:
        if getattr(r, "_extracted_cache", None) is cache:
            return getattr(r, _ATTR, None)
    key = list(tokens)
    owners = set()
    for r in requests:
        seq = list(r.prompt_token_ids or ())
        if len(seq) < len(key):
            seq += list(r.output_token_ids or ())
        if seq[:len(key)] == key:
            owners.add(getattr(r, _ATTR, None))
    return owners.pop() if len(owners) == 1 else UNKNOWN
