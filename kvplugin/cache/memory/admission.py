"""The admission policy of one host process: estimate, evict, admit or refuse.

Why a module of its own: the estimate (:mod:`kvplugin.cache.memory.footprint`) is arithmetic; this
is the policy around it that the session owns and every host adapter calls the same way:

1. ``learn_model`` once per loaded model: probe its cache layers (a few tokens through a fresh
   cache of the host's own classes) and note what the model holds when idle;
2. ``admit`` before a request's prefill: the ``kvplugin_admit`` hook may decide; otherwise the
   ledger does. When the request fits only without some stored entries, those are evicted
   first (LRU; counted as pressure evictions; the store hands their memory back). A refusal
   raises :class:`AdmissionRefused`, which the adapter answers as 413 or 503;
3. ``finish`` when the request is over, whatever happened to it.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from kvplugin.cache.memory.footprint import AdmissionRefused, Footprint, Ledger, Verdict, probe_footprint
from kvplugin.log import say

__all__ = ["AdmissionControl", "AdmissionRefused"]

_PROBE_TOKENS = 4
_REASONS = {413: "too_large", 503: "busy"}


class AdmissionControl:
    """``--max-memory`` for one process (``limit`` None: every request is admitted)."""

    def __init__(self, settings: Any, store: Any, hook: Any) -> None:
        self.settings = settings
        self.store = store
        self.hook = hook
        limit = settings.max_memory_bytes
        self.ledger = Ledger(limit) if limit is not None else None
        self._footprints: dict[int, Footprint] = {}
        self._lock = threading.Lock()
        self.admitted = 0
        self.refused = dict.fromkeys(_REASONS.values(), 0)
        self.pressure_evictions = 0
        self.last_need: int | None = None

    # -- models ---------------------------------------------------------------------------
    def learn_model(self, model: Any, fresh_cache: list, tokens: list[int] | None = None) -> None:
        """Probe ``model`` once (in the thread that runs it) and note its idle memory."""
        if self.ledger is None or id(model) in self._footprints:
            return
        import mlx.core as mx

        try:
            footprint = probe_footprint(model, fresh_cache, tokens or [1] * _PROBE_TOKENS)
        except Exception as exc:  # an unknown model interface: say so once, admit everything
            say(f"--max-memory: cannot estimate requests of {type(model).__module__} "
                f"({type(exc).__name__}: {exc}); its requests are admitted unchecked",
                key=f"admission:probe:{type(model).__module__}")
            return
        del fresh_cache
        with self._lock:
            self._footprints[id(model)] = footprint
        self.ledger.observe_idle(int(mx.get_active_memory()), self.store.nbytes)

    # -- requests -------------------------------------------------------------------------
    def admit(self, key: Hashable, model: Any, *, prompt_tokens: int, max_tokens: int,
              prefill_chunk: int, batched: bool = False) -> Verdict | None:
        """Admit (reserving) or raise :class:`AdmissionRefused`. None: no admission control."""
        ledger = self.ledger
        footprint = self._footprints.get(id(model))
        if ledger is None or footprint is None:
            return None
        import mlx.core as mx

        dequantize = bool(self.settings.kv_cache_quantization)
        need = footprint.need(prompt_tokens, max_tokens, prefill_chunk, dequantize=dequantize,
                              batched=batched)
        alone = footprint.need(prompt_tokens, max_tokens, prefill_chunk, dequantize=dequantize)
        stored = self.store.nbytes
        active = int(mx.get_active_memory())
        status = self.hook.kvplugin_admit(need=need, limit=ledger.limit, in_use=ledger.held,
                                          stored=stored, settings=self.settings)
        if status is None:  # kvplugin's own policy
            verdict, excess = ledger.judge(key, need, stored=stored, active=active, alone=alone)
            if verdict.admitted and excess:
                self._evict(excess)
        elif status == 200:  # a plugin admits: the ledger still counts it
            verdict = Verdict(200, need, ledger.limit)
            ledger.force(key, need)
        else:
            verdict = Verdict(int(status), need, ledger.limit,
                              f"kvplugin: a kvplugin_admit plugin refused this request "
                              f"(HTTP {status}; estimated need {need} bytes, limit "
                              f"{ledger.limit} bytes: --max-memory / KVPLUGIN_MAX_MEMORY)",
                              1 if status == 503 else None)
        with self._lock:
            self.last_need = need
            if verdict.admitted:
                self.admitted += 1
            else:
                self.refused[_REASONS.get(verdict.status, "busy")] += 1
        if not verdict.admitted:
            raise AdmissionRefused(verdict)
        return verdict

    def _evict(self, excess: int) -> None:
        before = self.store.stats().evictions
        self.store.trim_to(n_bytes=max(0, self.store.nbytes - excess))
        with self._lock:
            self.pressure_evictions += self.store.stats().evictions - before

    def finish(self, key: Hashable) -> None:
        """The request is over (answered, failed or refused): release its reservation."""
        ledger = self.ledger
        if ledger is None or not ledger.release(key):
            return
        import mlx.core as mx

        ledger.observe_idle(int(mx.get_active_memory()), self.store.nbytes)

    # -- reporting ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        ledger = self.ledger
        with self._lock:
            return {
                "max_memory": ledger.limit if ledger is not None else None,
                "admitted": self.admitted,
                "refused_too_large": self.refused["too_large"],
                "refused_busy": self.refused["busy"],
                "pressure_evictions": self.pressure_evictions,
                "admission_reserved": ledger.held if ledger is not None else None,
                "admission_base": ledger.base if ledger is not None else None,
                "admission_last_need": self.last_need,
            }
