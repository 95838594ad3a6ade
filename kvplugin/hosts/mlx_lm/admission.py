"""mlx-lm seams of admission control (``--max-memory``): translate, never decide.

``ResponseGenerator._tokenize`` (generation thread, both of mlx-lm's paths, before the prompt
cache is fetched and before any prefill)
    Wrapped: once the prompt is tokenized, the session's admission control admits the request
    (reserving its estimated need) or raises :class:`AdmissionRefused`; mlx-lm's own loop
    hands that exception to the waiting request, as it does any tokenization error, and goes
    on serving everyone else.
``ResponseGenerator.generate`` (handler thread)
    Wrapped: notes a refusal for this handler thread.
``APIHandler._set_completion_headers``
    Wrapped: mlx-lm answers any error from ``generate`` with 404; for a refusal the status is
    the verdict's (413 or 503) and a 503 carries ``Retry-After``. The body stays mlx-lm's
    ``{"error": message}``, the message naming the limit, the flag and the request's need.
``APIHandler.handle_completion``
    Wrapped: when it returns, however the request ended, its reservation is released.
"""

from __future__ import annotations

import threading
from typing import Any

from kvplugin.cache.memory.footprint import AdmissionRefused
from kvplugin.hosts.base import require, wraps_original

__all__ = ["check_admission_seams", "install_admission"]

_refusal = threading.local()  # the verdict of this handler thread's refused request


def check_admission_seams(server: Any) -> None:
    rg, handler = server.ResponseGenerator, server.APIHandler
    for owner, name in ((rg, "_tokenize"), (rg, "generate"), (rg, "_is_batchable"), (handler, "handle_completion"),
                        (handler, "_set_completion_headers")):
        require(callable(getattr(owner, name, None)), f"mlx_lm.server.{owner.__name__}.{name}")


def install_admission(adapter: Any, server: Any, patches: Any) -> None:
    rg, handler = server.ResponseGenerator, server.APIHandler
    patches.replace(rg, "_tokenize", _wrap_tokenize(adapter, rg._tokenize))
    patches.replace(rg, "generate", _wrap_generate(rg.generate))
    patches.replace(handler, "_set_completion_headers",
                    _wrap_headers(handler._set_completion_headers))
    patches.replace(handler, "handle_completion",
                    _wrap_handle_completion(adapter, handler.handle_completion))


def _wrap_tokenize(adapter: Any, original: Any) -> Any:
    @wraps_original(original)
    def _tokenize(generator, tokenizer, request, args, *rest: Any, **kwargs: Any) -> Any:
        result = original(generator, tokenizer, request, args, *rest, **kwargs)
        service = adapter.service
        if service is not None:
            service.admit(
                id(request), generator.model_provider.model, prompt_tokens=len(result[0]),
                max_tokens=int(getattr(args, "max_tokens", 0) or 0),
                prefill_chunk=int(generator.cli_args.prefill_step_size),
                batched=bool(generator._is_batchable(args)))
        return result

    return _tokenize


def _wrap_generate(original: Any) -> Any:
    @wraps_original(original)
    def generate(generator, *args: Any, **kwargs: Any) -> Any:
        _refusal.verdict = None
        try:
            return original(generator, *args, **kwargs)
        except AdmissionRefused as exc:
            _refusal.verdict = exc.verdict
            raise

    return generate


def _wrap_headers(original: Any) -> Any:
    @wraps_original(original)
    def _set_completion_headers(handler, status_code: int = 200, *args: Any, **kwargs: Any):
        verdict = getattr(_refusal, "verdict", None)
        if verdict is None or status_code != 404:
            return original(handler, status_code, *args, **kwargs)
        _refusal.verdict = None
        result = original(handler, verdict.status, *args, **kwargs)
        if verdict.retry_after_s is not None:
            handler.send_header("Retry-After", str(verdict.retry_after_s))
        return result

    return _set_completion_headers


def _wrap_handle_completion(adapter: Any, original: Any) -> Any:
    @wraps_original(original)
    def handle_completion(handler, request, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(handler, request, *args, **kwargs)
        finally:
            service = adapter.service
            if service is not None:
                service.request_done(id(request))

    return handle_completion
