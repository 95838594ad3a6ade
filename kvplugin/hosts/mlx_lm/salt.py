"""mlx-lm seams of a request's ``cache_salt``: carry it from the request to the prompt cache.

What the salt means is the session's (:meth:`KVService.request_salt`,
:meth:`KVService.salted_key`); this module only finds which request a prompt-cache call is for.
mlx-lm calls ``fetch_nearest_cache(model_key, tokens)`` / ``insert_cache`` on its generation
thread with the server's model key only, so the salt travels beside them:

``APIHandler.handle_completion`` (handler thread, both versions)
    Wrapped: the body's salt is checked (a bad one, or none under ``--kv-cache-require-salt``,
    is answered 400 as mlx-lm answers a bad parameter) and set on the ``CompletionRequest``,
    which mlx-lm hands to its generation thread (and pickles to other ranks).
``ResponseGenerator._tokenize`` (generation thread, right before each fetch)
    Wrapped: the request's salt becomes the salt of the next fetch on this thread.
``ResponseGenerator._serve_single``
    Wrapped: the sequential path fetches and inserts inside it, for its one request.
``BatchGenerator.insert_segments`` / ``extract_cache`` / ``next`` (``mlx_lm.generate``)
    Wrapped: a batched request's uid keeps the salt its fetch used; the caches mlx-lm then
    extracts at a segment end or at the finish come out as :class:`SaltedCache`, which
    ``insert_cache`` reads the salt from.

A call on the generation thread whose request cannot be told is neither served nor stored
(fail closed); outside mlx-lm's generation loop (a script using the prompt cache) there are
no salts.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from kvplugin.hosts.base import require, wraps_original

__all__ = ["UNKNOWN", "SaltedCache", "check_salt_seams", "fetch_salt", "insert_salt",
           "install_salt"]

#: The salt of a call whose request cannot be told.
UNKNOWN = object()
_ATTR = "_kvplugin_salt"  # on mlx-lm's CompletionRequest
_thread = threading.local()  # the generation thread's: tokenized, single, fetched, serving


class SaltedCache(list):
    """A batched request's extracted cache, carrying its request's salt to ``insert_cache``."""

    __slots__ = ("salt",)

    def __init__(self, layers: Any, salt: Any) -> None:
        super().__init__(layers)
        self.salt = salt


def fetch_salt() -> Any:
    """The salt of the fetch mlx-lm makes now on this thread (None outside its loop)."""
    if not getattr(_thread, "serving", False):
        return None
    salt = getattr(_thread, "tokenized", UNKNOWN)
    _thread.tokenized = UNKNOWN  # one fetch per tokenized request
    single = getattr(_thread, "single", UNKNOWN)
    _thread.fetched = single if single is not UNKNOWN else salt
    return _thread.fetched


def insert_salt(prompt_cache: Any) -> Any:
    """The salt of the request whose ``prompt_cache`` mlx-lm inserts now."""
    if isinstance(prompt_cache, SaltedCache):
        return prompt_cache.salt
    if not getattr(_thread, "serving", False):
        return None
    return getattr(_thread, "single", UNKNOWN)


def check_salt_seams(server: Any, gen_mod: Any) -> None:
    require(callable(getattr(server.APIHandler, "handle_completion", None)),
            "mlx_lm.server.APIHandler.handle_completion")
    for name in ("_tokenize", "_serve_single"):
        require(callable(getattr(server.ResponseGenerator, name, None)),
                f"mlx_lm.server.ResponseGenerator.{name}")
    for name in ("insert_segments", "extract_cache", "next"):
        require(callable(getattr(gen_mod.BatchGenerator, name, None)),
                f"mlx_lm.generate.BatchGenerator.{name}")


def install_salt(adapter: Any, server: Any, gen_mod: Any, patches: Any) -> None:
    """Patch the seams above (after :func:`check_salt_seams`)."""
    handler, rg, bg = server.APIHandler, server.ResponseGenerator, gen_mod.BatchGenerator
    patches.replace(handler, "handle_completion",
                    _wrap_handle_completion(adapter, handler.handle_completion))
    patches.replace(rg, "_tokenize", _wrap_tokenize(rg._tokenize))
    patches.replace(rg, "_serve_single", _wrap_serve_single(rg._serve_single))
    patches.replace(bg, "insert_segments", _wrap_insert_segments(bg.insert_segments))
    patches.replace(bg, "extract_cache", _wrap_extract_cache(bg.extract_cache))
    patches.replace(bg, "next", _wrap_next(bg.next))


def _wrap_handle_completion(adapter: Any, original: Any) -> Any:
    @wraps_original(original)
    def handle_completion(handler, request, *args: Any, **kwargs: Any) -> Any:
        service = adapter.service
        if service is not None:
            from kvplugin.cache.service.salt import SaltRefused

            try:
                salt = service.request_salt(getattr(handler, "body", None))
            except SaltRefused as exc:
                handler._set_completion_headers(400)
                handler.end_headers()
                handler.wfile.write(json.dumps({"error": str(exc)}).encode())
                return None
            setattr(request, _ATTR, salt)
        return original(handler, request, *args, **kwargs)

    return handle_completion


def _wrap_tokenize(original: Any) -> Any:
    @wraps_original(original)
    def _tokenize(generator, tokenizer, request, *args: Any, **kwargs: Any) -> Any:
        result = original(generator, tokenizer, request, *args, **kwargs)
        _thread.serving = True
        _thread.tokenized = getattr(request, _ATTR, None)
        return result

    return _tokenize


def _wrap_serve_single(original: Any) -> Any:
    @wraps_original(original)
    def _serve_single(generator, queued, *args: Any, **kwargs: Any) -> Any:
        _thread.serving = True
        _thread.single = getattr(queued[1], _ATTR, None)
        try:
            return original(generator, queued, *args, **kwargs)
        finally:
            _thread.single = UNKNOWN

    return _serve_single


def _salts(batch: Any) -> dict:
    """uid -> salt of one ``BatchGenerator`` (on the instance: it dies with the batch)."""
    return vars(batch).setdefault("_kvplugin_salts", {})


def _wrap_insert_segments(original: Any) -> Any:
    @wraps_original(original)
    def insert_segments(batch, *args: Any, **kwargs: Any) -> Any:
        uids = original(batch, *args, **kwargs)
        if getattr(_thread, "serving", False):
            salt = getattr(_thread, "fetched", UNKNOWN)
            _thread.fetched = UNKNOWN
            _salts(batch).update(dict.fromkeys(uids, salt))
        return uids

    return insert_segments


def _wrap_extract_cache(original: Any) -> Any:
    @wraps_original(original)
    def extract_cache(batch, uids, *args: Any, **kwargs: Any) -> Any:
        out = original(batch, uids, *args, **kwargs)
        salts = vars(batch).get("_kvplugin_salts")
        if salts is None or not isinstance(out, dict):
            return out
        return {uid: (SaltedCache(got[0], salts.get(uid, UNKNOWN)), *got[1:])
                for uid, got in out.items()}

    return extract_cache


def _wrap_next(original: Any) -> Any:
    @wraps_original(original)
    def next(batch, *args: Any, **kwargs: Any) -> Any:  # noqa: A001  (the host's name)
        out = original(batch, *args, **kwargs)
        salts = vars(batch).get("_kvplugin_salts")
        if salts is None:
            return out
        for r in out[1]:  # (prompt responses, generation responses)
            if getattr(r, "finish_reason", None) is not None and isinstance(
                    getattr(r, "prompt_cache", None), list):
                r.prompt_cache = SaltedCache(r.prompt_cache, salts.pop(r.uid, UNKNOWN))
        return out

    return next
