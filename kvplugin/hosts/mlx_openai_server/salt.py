"""mlx-openai-server seams of a request's ``cache_salt``: carry it from the request to the
prompt cache, in the model process, on both generation paths.

What the salt means is the service's (:meth:`KVService.request_salt`,
:meth:`KVService.salted_key`); this module only finds which request a prompt-cache call is
for. The host's request model keeps unknown fields (``extra="allow"``), so ``cache_salt``
reaches the model process on the request itself.

``MLXLMHandler._build_inference_context`` (the request's task, before any fetch)
    Wrapped: the salt is checked (a bad one, or none under ``--kv-cache-require-salt``, is
    answered 400 naming the field) and becomes the salt of the request's task.
single-request path
    Its fetch runs in that task; the cache it fetches or makes is tagged with the salt, and
    its insert (on the host's worker thread) reads the tag back.
``app.core.batch_scheduler._PendingRequest`` / ``BatchScheduler.__init__``
    The queued request keeps its task's salt; the scheduler thread takes it as the salt of
    what it does next for that request (its fetch, ``BatchGenerator.insert_segments``).
``BatchGenerator.insert_segments`` / ``extract_cache`` / ``next``
    As on mlx-lm: a uid keeps its salt, and the caches extracted for it come out as
    :class:`~kvplugin.hosts.mlx_lm.salt.SaltedCache`, which ``insert_cache`` reads.

A cache whose request cannot be told is neither served nor stored (fail closed); outside a
request (a script using the prompt cache) there are no salts.
"""

from __future__ import annotations

import contextvars
import threading
import types
from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import PatchRegistry, require, wraps_original
from kvplugin.hosts.mlx_lm.salt import UNKNOWN, SaltedCache, _wrap_extract_cache, _wrap_next

__all__ = ["UNKNOWN", "check_salt_seams", "fetch_salt", "insert_salt", "install_salt",
           "tag_cache"]

_ATTR = "_kvplugin_salt"  # on the host's queued request and on a cache's first layer
_task_salt: contextvars.ContextVar = contextvars.ContextVar("kvplugin_oai_salt", default=None)
_thread = threading.local()  # the scheduler thread's: the request it works for now
#: True while the seams are patched (a model process): an untagged cache is then unmatched
_INSTALLED = False


def fetch_salt() -> Any:
    """The salt of the fetch made now: the scheduler's request, else the request's task."""
    if getattr(_thread, "scheduler", False):
        return getattr(_thread, "salt", UNKNOWN)
    return _task_salt.get()


def tag_cache(cache: Any, salt: Any) -> None:
    """Mark a single-request cache with its request's salt (its insert runs elsewhere)."""
    if cache:
        try:
            setattr(cache[0], _ATTR, salt)
        except (AttributeError, TypeError):
            pass  # a layer without a __dict__: its insert is not matched, so not stored


def insert_salt(prompt_cache: Any) -> Any:
    """The salt of the request whose ``prompt_cache`` the host inserts now."""
    if isinstance(prompt_cache, SaltedCache):
        return prompt_cache.salt
    untagged = UNKNOWN if _INSTALLED else None
    return getattr(prompt_cache[0], _ATTR, untagged) if prompt_cache else untagged


def check_salt_seams(sched_mod: Any, gen_mod: Any) -> None:
    pending = getattr(sched_mod, "_PendingRequest", None)
    require(isinstance(pending, type) and "input_ids" in getattr(
        pending, "__dataclass_fields__", {}), "app.core.batch_scheduler._PendingRequest")
    require(callable(getattr(getattr(sched_mod, "BatchScheduler", None), "_admit_pending",
                             None)), "BatchScheduler._admit_pending")
    for name in ("insert_segments", "extract_cache", "next"):
        require(callable(getattr(gen_mod.BatchGenerator, name, None)),
                f"mlx_lm.generate.BatchGenerator.{name}")


def install_salt(adapter: Any, handler_cls: Any, sched_mod: Any, gen_mod: Any,
                 refusals: dict, patches: PatchRegistry) -> None:
    """Patch the seams above (after :func:`check_salt_seams`); ``refusals`` is admission's
    table of answers the generation wrappers give instead of the host's own."""
    import sys

    patches.replace(sys.modules[__name__], "_INSTALLED", True)
    patches.replace(handler_cls, "_build_inference_context",
                    _wrap_build(adapter, handler_cls._build_inference_context, refusals))
    patches.replace(sched_mod, "_PendingRequest", _salted_pending(sched_mod._PendingRequest))
    sched = sched_mod.BatchScheduler
    patches.replace(sched, "__init__", _wrap_scheduler_init(sched.__init__))
    bg = gen_mod.BatchGenerator
    patches.replace(bg, "insert_segments", _wrap_insert_segments(bg.insert_segments))
    patches.replace(bg, "extract_cache", _wrap_extract_cache(bg.extract_cache))
    patches.replace(bg, "next", _wrap_next(bg.next))


def _wrap_build(adapter: Any, original: Callable, refusals: dict) -> Callable:
    @wraps_original(original)
    async def _build_inference_context(handler: Any, request: Any, *args: Any, **kw: Any):
        service = adapter.service
        if service is not None:
            from kvplugin.cache.service.salt import SaltRefused

            try:
                salt = service.request_salt(getattr(request, "model_extra", None) or {})
            except SaltRefused as exc:
                refusals[id(request)] = types.SimpleNamespace(
                    status=400, reason=str(exc), retry_after_s=None)
                raise
            _task_salt.set(salt)
        return await original(handler, request, *args, **kw)

    return _build_inference_context


def _salted_pending(original: type) -> type:
    class _PendingRequest(original):  # type: ignore[misc, valid-type]
        """The host's queued request, keeping the salt of the task that queued it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            setattr(self, _ATTR, _task_salt.get())

    _PendingRequest.__qualname__ = original.__qualname__
    _PendingRequest.__module__ = original.__module__
    return _PendingRequest


def _taking(get: Callable) -> Callable:
    """The scheduler queue's ``get``: the request taken is the one the thread works for."""

    def take(*args: Any, **kwargs: Any) -> Any:
        _thread.scheduler, _thread.salt = True, UNKNOWN
        request = get(*args, **kwargs)
        _thread.salt = getattr(request, _ATTR, UNKNOWN)
        return request

    return take


def _wrap_scheduler_init(original: Callable) -> Callable:
    @wraps_original(original)
    def __init__(scheduler: Any, *args: Any, **kwargs: Any) -> None:
        original(scheduler, *args, **kwargs)
        q = scheduler._admission_queue  # an instance's queue: its methods, not the class's
        q.get, q.get_nowait = _taking(q.get), _taking(q.get_nowait)

    return __init__


def _wrap_insert_segments(original: Callable) -> Callable:
    @wraps_original(original)
    def insert_segments(batch: Any, *args: Any, **kwargs: Any) -> Any:
        uids = original(batch, *args, **kwargs)
        if getattr(_thread, "scheduler", False):
            salts = vars(batch).setdefault("_kvplugin_salts", {})
            salts.update(dict.fromkeys(uids, getattr(_thread, "salt", UNKNOWN)))
        return uids

    return insert_segments
