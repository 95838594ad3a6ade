"""mlx-openai-server seams of admission control (``--max-memory``): translate, never decide.

``MLXLMHandler._build_inference_context`` (the model process, before the prompt cache is
fetched and before the request reaches the batch scheduler or the single-request worker)
    Wrapped: once the prompt is tokenized, the request is counted as running and the service
    admits it (reserving its estimated need) or refuses it.
``MLXLMHandler.generate_text_response`` / ``generate_text_stream``
    Wrapped: the host answers any error of its own with 500; a refusal is answered with the
    verdict's status (413 never fits, 503 busy) and its reason instead, and the reservation
    is released when the answer ends, however it ends. (The server process re-raises the
    model process's status and detail; headers such as ``Retry-After`` do not cross.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvplugin.hosts.base import PatchRegistry, wraps_original

__all__ = ["install_admission"]


def install_admission(adapter: Any, handler_cls: Any, patches: PatchRegistry) -> dict:
    """Patch the seams above; returns the table of refusals (``id(request)`` -> a verdict's
    status, reason and ``retry_after_s``) that the generation wrappers answer with."""
    refusals: dict[int, Any] = {}  # id(request) -> its verdict, while its answer unwinds
    patches.replace(handler_cls, "_build_inference_context",
                    _wrap_build(adapter, handler_cls._build_inference_context, refusals))
    patches.replace(handler_cls, "generate_text_response",
                    _wrap_response(adapter, handler_cls.generate_text_response, refusals))
    patches.replace(handler_cls, "generate_text_stream",
                    _wrap_stream(adapter, handler_cls.generate_text_stream, refusals))
    return refusals


def _wrap_build(adapter: Any, original: Callable, refusals: dict) -> Callable:
    @wraps_original(original)
    async def _build_inference_context(handler: Any, request: Any, *args: Any, **kw: Any):
        ctx = await original(handler, request, *args, **kw)
        service = adapter.service
        if service is None:
            return ctx
        service.request_started(id(request))
        if service.admission_on:
            from kvplugin.cache.memory.footprint import AdmissionRefused

            try:
                service.admit(
                    id(request), handler.model.model, prompt_tokens=int(ctx.total_input_tokens),
                    max_tokens=int((ctx.model_params or {}).get("max_tokens") or 0),
                    prefill_chunk=int(getattr(handler, "_batch_prefill_step_size", 2048)),
                    batched=bool(handler._is_request_batchable(request)))
            except AdmissionRefused as exc:
                refusals[id(request)] = exc.verdict
                raise
        return ctx

    return _build_inference_context


def _refused(refusals: dict, request: Any) -> Exception | None:
    verdict = refusals.pop(id(request), None)
    if verdict is None:
        return None
    from fastapi import HTTPException

    headers = ({"Retry-After": str(verdict.retry_after_s)}
               if verdict.retry_after_s is not None else None)
    return HTTPException(status_code=verdict.status, detail=verdict.reason, headers=headers)


def _done(adapter: Any, request: Any) -> None:
    service = adapter.service
    if service is not None:
        service.request_done(id(request))


def _wrap_response(adapter: Any, original: Callable, refusals: dict) -> Callable:
    @wraps_original(original)
    async def generate_text_response(handler: Any, request: Any, *args: Any, **kw: Any):
        try:
            return await original(handler, request, *args, **kw)
        except Exception as exc:
            refused = _refused(refusals, request)
            if refused is not None:
                raise refused from None
            raise exc
        finally:
            _done(adapter, request)

    return generate_text_response


def _wrap_stream(adapter: Any, original: Callable, refusals: dict) -> Callable:
    @wraps_original(original)
    async def generate_text_stream(handler: Any, request: Any, *args: Any, **kw: Any):
        try:
            async for chunk in original(handler, request, *args, **kw):
                yield chunk
        except Exception as exc:
            refused = _refused(refusals, request)
            if refused is not None:
                raise refused from None
            raise exc
        finally:
            _done(adapter, request)

    return generate_text_stream
