"""vllm-mlx seams of admission control (``--max-memory``): translate, never decide.

A refusal becomes vllm-mlx's own kind of error, FastAPI's ``HTTPException`` (413, or 503 with
``Retry-After``), which its routes pass through unchanged (``except HTTPException: raise``).

Default mode: :func:`kvplugin.hosts.vllm_mlx.simple.cached_generation` admits each
generation before its prefix is fetched and finishes it when the generation ends.

``--continuous-batching``:

``Scheduler.add_request`` (the generation worker, before the prefix-cache lookup)
    Wrapped: tokenizes a text prompt the way the original would (so it is not done twice),
    then admits the request under its id or raises; vllm-mlx's ``EngineCore.add_request``
    already cleans up after any exception there.
``Scheduler._cleanup_finished`` / ``Scheduler.abort_request``
    Wrapped: the finished or aborted requests' reservations are released.
"""

from __future__ import annotations

from typing import Any

from kvplugin.hosts.base import PatchRegistry, require_attrs, wraps_original

__all__ = ["admit_or_raise", "check_seams", "install"]


def admit_or_raise(service: Any, key: Any, model: Any, *, prompt_tokens: int, max_tokens: int,
                   prefill_chunk: int, batched: bool = False) -> None:
    """The session's admission control; a refusal as the ``HTTPException`` vllm-mlx answers."""
    from kvplugin.cache.memory.footprint import AdmissionRefused

    try:
        service.admit(key, model, prompt_tokens=prompt_tokens,
                                max_tokens=int(max_tokens or 0), prefill_chunk=prefill_chunk,
                                batched=batched)
    except AdmissionRefused as exc:
        from fastapi import HTTPException

        verdict = exc.verdict
        headers = ({"Retry-After": str(verdict.retry_after_s)}
                   if verdict.retry_after_s is not None else None)
        raise HTTPException(status_code=verdict.status, detail=verdict.reason,
                            headers=headers) from None


def check_seams(scheduler: Any) -> None:
    require_attrs(scheduler.Scheduler, "add_request", "_cleanup_finished", "abort_request")


def install(patches: PatchRegistry, adapter: Any, scheduler: Any) -> None:
    sched = scheduler.Scheduler
    patches.replace(sched, "add_request", _wrap_add_request(sched.add_request, adapter))
    patches.replace(sched, "_cleanup_finished",
                    _wrap_cleanup(sched._cleanup_finished, adapter))
    patches.replace(sched, "abort_request", _wrap_abort(sched.abort_request, adapter))


def _wrap_add_request(original: Any, adapter: Any) -> Any:
    @wraps_original(original)
    def add_request(self, request, *args: Any, **kwargs: Any) -> Any:
        service = adapter.runtime.service
        if service is not None and service.admission_on:
            if request.prompt_token_ids is None and isinstance(request.prompt, str) \
                    and hasattr(self.tokenizer, "encode"):
                request.prompt_token_ids = self.tokenizer.encode(request.prompt)
                request.num_prompt_tokens = len(request.prompt_token_ids)
            if request.prompt_token_ids is not None:
                admit_or_raise(
                    service, request.request_id, self.model,
                    prompt_tokens=len(request.prompt_token_ids),
                    max_tokens=request.sampling_params.max_tokens,
                    prefill_chunk=int(getattr(self.config, "prefill_step_size", 2048) or 2048),
                    batched=True)
        return original(self, request, *args, **kwargs)

    return add_request


def _finish(adapter: Any, request_ids: Any) -> None:
    service = adapter.runtime.service
    if service is not None:
        for rid in list(request_ids):
            service.request_done(rid)


def _wrap_cleanup(original: Any, adapter: Any) -> Any:
    @wraps_original(original)
    def _cleanup_finished(self, finished_ids, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, finished_ids, *args, **kwargs)
        finally:
            _finish(adapter, finished_ids)

    return _cleanup_finished


def _wrap_abort(original: Any, adapter: Any) -> Any:
    @wraps_original(original)
    def abort_request(self, request_id, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, request_id, *args, **kwargs)
        finally:
            _finish(adapter, [request_id])

    return abort_request
