"""The engine's front desk, and the one place every kvplugin policy is decided.

A host adapter only translates: at each host seam it calls one method of the process's
:class:`KVService` (or one function below, for decisions needed before the service exists)
and applies the answer in the host's own terms. What is decided here, once for every host:

* configure / unconfigure: ``kvplugin_configure`` once per hook relay, ``kvplugin_unconfigure``
  at :meth:`KVService.close` (after the store is flushed and closed);
* the cold tier: asked of ``kvplugin_store_backend``, never under ``hot_cache_only``;
* persistence across restarts (:meth:`~KVService.persist`, :meth:`~KVService.reload`),
  through the same backend hook, on the host's directory;
* what an entry is keyed by, trimmed and quantized to (:meth:`~KVService.give_back`);
* how fresh caches are shaped (:meth:`~KVService.make_cache`, which also says once per model
  which layers its settings cannot reach) and the batch plan (:meth:`~KVService.batch_plan`);
* what a host may read and do to the store and admission (:mod:`.holdings`);
* (the start-up checks hosts run before a session exists live in
  :mod:`kvplugin.cache.service.startup_checks`);
* the one ``active`` line (:meth:`~KVService.active_line`) and the report/stats.

The hook relay (``pm.hook``) is passed in: the engine never imports the plugin manager.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvplugin.cache.layers import entry_arrays, entry_nbytes, entry_tokens, layer_bits
from kvplugin.cache.bounded.prealloc import rewind_decode
from kvplugin.cache.memory.admission import AdmissionControl
from kvplugin.cache.memory.release import trim_heap
from kvplugin.cache.store.prompts import RecentPrompts
from kvplugin.cache.store.prompt_store import PromptStore
from kvplugin.cache.service.holdings import Holdings
from kvplugin.cache.service.idle_hold import IdleHold
from kvplugin.cache.service.persist import Persistence
from kvplugin.cache.service.pressure import (fit_at_insert, is_quantized, quantize_at_store,
                                             quantizes_at_store, store_demotion)
from kvplugin.cache.service.report import Reporting
from kvplugin.cache.service.counters import BatchPlan, Counters, entry_codec
from kvplugin.cache.service.fit import ModelChecker
from kvplugin.settings import KVPluginSettings

__all__ = ["BatchPlan", "Counters", "KVService", "store_key"]

log = logging.getLogger("kvplugin")

_UNLIMITED = 1 << 62


def _configure_once(hook: Any, settings: KVPluginSettings, host: str) -> bool:
    """Fire ``kvplugin_configure`` unless this relay already did (True if it fired now).

    Historic: a plugin registered later still receives the call. Once per relay, i.e. once
    per process for the process-wide manager, however many stores a process builds.
    """
    caller = hook.kvplugin_configure
    if getattr(caller, "_call_history", None):  # pluggy keeps the historic calls made
        return False
    caller.call_historic(kwargs={"settings": settings, "host": host})
    return True


class KVService(Holdings, Persistence, Reporting):
    """Settings + hooks + store for one host process; every policy decision lives here."""

    def __init__(
        self,
        settings: KVPluginSettings,
        *,
        host: str,
        hook: Any,
        max_bytes: int | None = None,
        max_entries: int | None = None,
    ) -> None:
        self.settings = settings
        self.host = host
        self.hook = hook
        self.counters = Counters()
        self._lock = threading.Lock()
        self._closed = False
        self._owns_configure = _configure_once(hook, settings, host)
        self._recent_prompts = RecentPrompts()  # where stored entries' prompts ended
        self._rejected_by_kind: dict[str, int] = {}
        self._checker = ModelChecker()
        self._bytes_by_codec: dict[str, int] = {}
        self._shaped_models: set[int] = set()  # models whose first fresh cache was described
        cold = None if settings.hot_cache_only else hook.kvplugin_store_backend(settings=settings)
        self.store = PromptStore(
            max_bytes=max_bytes if max_bytes is not None else _UNLIMITED,
            max_entries=max_entries,
            cold=cold,
            on_evict=self._on_evict,
            after_evictions=self.release_memory,
            on_spill=lambda tokens, cache: self._event("spill", len(tokens), cache),
            **store_demotion(self),
        )
        self.admission = AdmissionControl(settings, self.store, hook)
        trim_heap()  # what start-up freed (the settings), before the host loads its model

    def model_key(self, fingerprint: str) -> str:
        """The store's model key for a checkpoint ``fingerprint`` served by this process."""
        return store_key(self.host, fingerprint, self.settings)

    def request_salt(self, body: Any) -> str | None:
        """The ``cache_salt`` of a request's JSON body (None: none); raises
        :class:`~kvplugin.cache.service.salt.SaltRefused` (the host answers 400) for a bad one, or for
        none under ``--kv-cache-require-salt``."""
        from kvplugin.cache.service.salt import salt_of

        return salt_of(body, required=self.settings.kv_cache_require_salt)

    @staticmethod
    def salted_key(model_key: str, salt: str | None) -> str:
        """The model key a request with ``salt`` is served under: every tier keys by it, so
        requests of two salts never share a prefix (:mod:`kvplugin.cache.service.salt`)."""
        from kvplugin.cache.service.salt import salted_key

        return salted_key(model_key, salt)

    # -- cache construction -------------------------------------------------------------
    def make_cache(self, model: Any, cache: list) -> list:
        """The host just built a fresh per-request cache: bound / re-step it, and say once per
        model which of its layers ``--max-kv-size`` / ``--kv-cache-step`` cannot reach."""
        shaped = self.hook.kvplugin_make_cache(model=model, cache=cache, settings=self.settings)
        with self._lock:
            self.counters.caches_made += 1
            if shaped is not None and self.settings.max_kv_size is not None:
                self.counters.caches_bounded += 1
            first = id(model) not in self._shaped_models
            self._shaped_models.add(id(model))
        result = cache if shaped is None else shaped
        if first:
            from kvplugin.cache.bounded.reach import reach_notice
            from kvplugin.log import say

            line = reach_notice(self.settings, model, result)
            if line is not None:
                say(line, key=f"{self.host}:{id(model)}:{line}")
        return result

    def learn_model(self, model: Any, fresh_cache: list, *, serving_thread: bool = False) -> None:
        """A host loaded ``model`` (call it in the thread that runs it, before it serves):
        admission control probes its memory per token, the codec learns each layer's key rope
        (:attr:`key_ropes`) and is warmed up (:func:`~kvplugin.cache.codec.quantize.warm_up`;
        after the load, so its code pages are not under the load's peak). ``serving_thread``:
        it does the requests' cache work too (mlx-lm), so the codec lanes start here."""
        if serving_thread:
            from kvplugin.cache.codec.lanes import open_lanes

            open_lanes()
        from kvplugin.cache.model.rope import key_ropes

        self.key_ropes = key_ropes(model, fresh_cache)
        if self.admission.ledger is not None:
            shaped = self.hook.kvplugin_make_cache(model=model, cache=fresh_cache,
                                                   settings=self.settings)
            self.admission.learn_model(model, fresh_cache if shaped is None else shaped)
        if self.settings.kv_cache_quantization:
            from kvplugin.cache.codec.quantize import warm_up
            from kvplugin.codecs import codec_plan

            warm_up(codec_plan(self.settings))
        trim_heap()  # what the probe and the host's load freed, before the first request

    def batch_plan(self) -> BatchPlan:
        """How a host's batched path runs (a host applies it in its own terms).

        Batched paths merge every request into ``BatchKVCache`` / ``BatchRotatingKVCache``,
        which grow by their class ``step``: ``--kv-cache-step`` carries over, and a bounded
        cache grows to the bound in one step (never beyond: ``min(step, max_size - prev)``).
        Under ``--max-kv-size`` every fresh cache of the batch is :meth:`make_cache`'s.
        """
        steps: dict[str, int] = {}
        if self.settings.kv_cache_step is not None:
            steps["BatchKVCache"] = int(self.settings.kv_cache_step)
        bound = self.settings.max_kv_size
        if bound is not None:
            steps["BatchRotatingKVCache"] = int(bound)
        return BatchPlan(steps, None if bound is None else int(bound))

    # -- storing ----------------------------------------------------------------------------
    def prepare_entry(self, cache: list, num_tokens: int,
                      tokens: Sequence[int] | None = None, *,
                      stored_prefix: list | None = None, model_key: str | None = None) -> list:
        """Trim and (per settings) quantize an entry before it is stored; ``tokens`` (what it
        holds) and ``model_key`` (what it is stored under) tell the codec where earlier
        prompts ended (:mod:`kvplugin.cache.store.prompts`), ``stored_prefix``
        (:meth:`PromptStore.stored_prefix`) which rows it quantized already."""
        before = entry_nbytes(cache)
        trimmed = self.hook.kvplugin_trim_entry(cache=cache)
        entry = cache if trimmed is None else trimmed
        self._event("trim", num_tokens, entry)
        entry, quantized = quantize_at_store(self, model_key, tokens or (), entry, num_tokens,
                                             stored_prefix)
        after = entry_nbytes(entry)
        with self._lock:
            self.counters.entries_stored += 1
            self.counters.bytes_before += before
            self.counters.bytes_stored += after
            codec = entry_codec(entry)
            self._bytes_by_codec[codec] = self._bytes_by_codec.get(codec, 0) + after
            if quantized:
                self.counters.entries_quantized += 1
        return entry

    def stored_prefix(self, model_key: str, tokens: Sequence[int]) -> list | None:
        """What :meth:`prepare_entry`'s codec may copy rows from (None when nothing is
        quantized as it is stored): call it before the entry's lent snapshot is settled."""
        if quantizes_at_store(self.settings):
            return self.store.stored_prefix(model_key, tokens)
        if self.store.demote is None:
            return None
        # under pressure only a demoted one: a full-precision donor has no rows to copy, and
        # would keep the host's live layers whole beside the entry being trimmed
        donor = self.store.stored_prefix(model_key, tokens)
        return donor if donor and is_quantized(donor) else None

    def insert(self, model_key: str, tokens: Sequence[int], cache: list, *,
               kind: str | None = None) -> bool:
        """Trim/quantize ``cache`` and store it under ``tokens`` (it is owned by us now)."""
        entry = self._prepare_owned(model_key, tokens, cache)
        if entry is cache and self.store.demote is not None:
            entry = list(cache)  # the host's list must not keep layers a demotion replaces
        if entry is not cache:
            # The host may keep its list object a while (mlx-lm's loop holds the last
            # response): drop its references now so a replaced full-precision original is
            # freed at insert, not at the next request.
            cache.clear()
        return self.store_prepared(model_key, tokens, entry, kind=kind)

    def _prepare_owned(self, model_key: str, tokens: Sequence[int], cache: list) -> list:
        donor = self.stored_prefix(model_key, tokens)
        self.store.settle_lent(model_key, tokens, cache)  # so its layers go as they are cut
        return self.prepare_entry(cache, len(tokens), tokens, stored_prefix=donor,
                                  model_key=model_key)

    def prepare_finished(self, model_key: str, tokens: Sequence[int], cache: list, *,
                         min_tokens: int = 1) -> tuple[list[int], list] | None:
        """:meth:`give_back` up to the store: the key it would use and the entry it would
        keep, for a host that commits entries under its own lock (:meth:`store_prepared`).
        One sequence for every host path; None: nothing to store."""
        key = self._finished_key(cache, tokens, min_tokens)
        if key is None:
            return None
        return key, self._prepare_owned(model_key, key, cache)

    def store_prepared(self, model_key: str, tokens: Sequence[int], entry: list, *,
                       prompt_len: int | None = None, kind: str | None = None) -> bool:
        """Keep an entry :meth:`prepare_entry` made: into the store, then written through to
        a tier that shares entries (the remote one), from this thread (it owns the arrays).

        ``prompt_len`` (where the prompt ended in ``tokens``) is learnt from recent fetches
        when not given (:mod:`kvplugin.cache.store.prompts`), for every host path alike: without it a
        conversation's previous turn is never superseded and the store holds it once per turn.
        """
        if prompt_len is None:
            prompt_len = self._recent_prompts.prompt_len(model_key, tokens)
        # under pressure: quantized here where the budget cannot hold it (it may have changed)
        entry, demoted = fit_at_insert(self, model_key, tokens, entry)
        # Evaluated here where another thread may take it (a cold tier's spill or flush, the
        # demotion worker, a host serving it elsewhere): MLX cannot run a graph made on this
        # thread's streams there. Otherwise lazy: copied once the live cache has gone.
        if self.evaluate_at_store or self.store.cold is not None or self.store.demote is not None:
            mx.eval(entry_arrays(entry))
        stored = self.store.insert(model_key, list(tokens), entry, prompt_len=prompt_len,
                                   demoted=demoted, kind=kind, cold_only=self.idle_hold
                                   is not None and not self.idle_hold.may_hold())
        if stored:
            self._event("store", len(tokens), entry)
            self.store.publish(model_key, tokens, entry)
        return stored

    def hold_between_requests(self) -> None:
        """Keep entries in memory only while no other request runs (a host whose stock
        holds none there): see :mod:`kvplugin.cache.service.idle_hold`."""
        self.idle_hold = IdleHold(self.store)

    def request_started(self, key: Any) -> None:
        """A request begins (before its fetch): counted where entries are held only between
        requests (:mod:`kvplugin.cache.service.idle_hold`)."""
        if self.idle_hold is not None:
            self.idle_hold.started(key)

    def request_done(self, key: Any) -> None:
        """A request is over (answered, failed or refused): its admission reservation goes,
        and MLX's buffer cache is handed back when it holds more than a quarter of the memory
        limit (``--max-memory``; off: of physical memory). Below that the buffers are kept
        for the next request to reuse, as MLX intends."""
        self.admission.finish(key)
        if self.idle_hold is not None:
            self.idle_hold.done(key)
        from kvplugin.resources import physical_memory
        from kvplugin.cache.memory.release import buffer_cache_bytes

        ledger = self.admission.ledger
        limit = ledger.limit if ledger is not None else physical_memory()
        if buffer_cache_bytes() > limit // 4:
            self.release_memory()

    def _event(self, event: str, tokens: int, cache: list | None = None,
               seconds: float = 0.0) -> None:
        """Tell observers (``kvplugin_cache_event``) what just happened, to how much, and how
        long its work took (0: not measured)."""
        caller = self.hook.kvplugin_cache_event
        if not caller.get_hookimpls():  # nobody listens: keep the request path free of it
            return
        nbytes = entry_nbytes(cache) if cache else 0
        caller(event=event, tokens=int(tokens), nbytes=nbytes, seconds=float(seconds))

    def give_back(self, model_key: str, tokens: Sequence[int], cache: list, *,
                  min_tokens: int = 1, kind: str | None = None) -> bool:
        """A finished request's cache: store it keyed by exactly what it holds (``kind``:
        the host's kind of entry, :mod:`kvplugin.cache.store.order`).

        Hosts key an entry by the tokens they fed; a cache may hold fewer (an unreported
        prefill) or more (an EOS fed but not returned). The key is cut, or the cache trimmed
        when it is trimmable, rather than store an entry whose key lies about its contents:
        a wrong key would hand one conversation's KV to another. False: not stored.
        """
        key = self._finished_key(cache, tokens, min_tokens)
        return key is not None and self.insert(model_key, key, cache, kind=kind)

    def _finished_key(self, cache: list, tokens: Sequence[int], min_tokens: int) -> list | None:
        if entry_tokens(cache) == 0:
            return None  # nothing was computed: nothing to store
        key = self.key_for_cache(cache, list(tokens))
        if key is None:
            self._reject(cache, "it holds more tokens than its key and cannot be trimmed")
            return None
        return key if len(key) >= min_tokens else None

    def _reject(self, cache: list, why: str) -> None:
        """A cache that cannot be stored is counted by layer kind and said once, never silent."""
        kinds = ",".join(sorted({type(layer).__name__ for layer in cache})) or "empty"
        with self._lock:
            self.counters.entries_rejected += 1
            self._rejected_by_kind[kinds] = self._rejected_by_kind.get(kinds, 0) + 1
        from kvplugin.log import say

        say(f"an entry of {kinds} layers was not stored: {why}", key=f"reject:{kinds}:{why}")

    @staticmethod
    def key_for_cache(cache: list, tokens: list[int]) -> list[int] | None:
        """The store key that matches what ``cache`` really holds, or ``None`` to skip."""
        rewind_decode(cache)  # a wrapped bounded entry goes back to its prompt boundary
        held = entry_tokens(cache)
        if held is None or held == len(tokens):
            return tokens  # no layer counts tokens (recurrent state): the host's key stands
        if held <= 0:
            return None
        if held < len(tokens):
            return tokens[:held]
        if all(getattr(c, "is_trimmable", lambda: False)() for c in cache):
            for c in cache:
                c.trim(held - len(tokens))
            # a layer may trim less than asked (a chunked one, past its front): then it lies
            return tokens if entry_tokens(cache) == len(tokens) else None
        return None

    # -- fetching -----------------------------------------------------------------------------
    def fetch(self, model_key: str, tokens: Sequence[int], *,
              model: Any = None) -> tuple[list | None, int]:
        """The best stored entry for ``tokens``, dequantized, owned by the caller.

        With ``model`` (the model the host will run it with), an entry from the cold tier is
        first checked against the model's own cache (:mod:`kvplugin.cache.service.fit`): one that
        does not fit is a counted miss (``entries_invalid``), said once, never handed over.

        Returns ``(cache, n)``: the cache covers the first ``n`` tokens of ``tokens`` (at
        least one token is always left to process), or ``(None, 0)`` on a miss. Nothing is
        allocated here for an fp16 entry: a moved entry is the stored arrays themselves and a
        shared prefix is a view of its donor. Growth room is not added either: the batched
        path copies the cache into its batch anyway, and a model's forward pass frees each
        layer's old buffer as it grows, so room given here would be a whole entry at the peak.
        """
        self._recent_prompts.add(model_key, tokens)
        check = None if model is None else (lambda entry: self._fits(model, entry))
        from kvplugin.cache.codec.quantize import UnknownCodec

        dequantized = False

        def dequantize(cache: list) -> list:  # the store lends a moved entry once dequantized
            nonlocal dequantized
            quantized = sum(layer_bits(layer) is not None for layer in cache)
            restored = self.dequantize(cache)  # may change `cache` (a copy) in place
            dequantized = sum(layer_bits(layer) is not None for layer in restored) < quantized
            return restored

        try:
            restored, n = self.store.fetch(model_key, list(tokens), check=check,
                                           dequantize=dequantize)
        except UnknownCodec as e:  # written by another kvplugin version: a miss, never misread
            log.warning("kvplugin: stored entry not used (%s); treated as a miss", e)
            restored = None
        finally:
            if self.idle_hold is not None:
                self.idle_hold.fetched()
        if restored is None:
            self._event("miss", len(tokens))
            log.debug("prompt cache miss: %d prompt tokens", len(tokens))
            return None, 0
        if dequantized:
            self._event("dequantize", n, restored)
            self.release_memory()  # the codec's temporaries, before the prefill (as above)
        self._event("fetch", n, restored)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prompt cache hit: %d of %d prompt tokens reused, entry %d bytes",
                      n, len(tokens), entry_nbytes(restored))
        return restored, n

    def _fits(self, model: Any, entry: list) -> bool:
        """Does ``entry`` fit ``model``? A misfit is counted and said once per model."""
        problem = self._checker.problem(model, entry)
        if problem is None:
            return True
        with self._lock:
            self.counters.entries_invalid += 1
        from kvplugin.log import say

        say(f"a stored entry does not fit the model and was not used: {problem} (said once "
            f"per model; every one is counted in entries_invalid)",
            key=f"invalid:{id(model)}")
        return False

    #: ``(bits, group_size, start)`` of the host's quantized live caches (mlx-lm
    #: ``--kv-bits``, :meth:`learn_live_quantization`); None: full-precision live caches.
    live_quantization: tuple[int, int, int] | None = None
    #: Each cache layer's key rope of the model the host loaded last (:meth:`learn_model`,
    #: :mod:`kvplugin.cache.model.rope`); None: unknown, keys stored as the model made them
    key_ropes: tuple | None = None
    #: a host whose entries are served on another thread than the one that stored them
    evaluate_at_store: bool = False
    #: a host whose stock holds no entry in memory: entries held only between requests
    idle_hold: IdleHold | None = None

    def dequantize(self, cache: list) -> list:
        """The entry as the host runs it: dequantized, except layers already quantized the
        way the host's own live cache is (``live_quantization``), which are handed back as
        they are."""
        live = self.live_quantization
        keep: dict[int, Any] = {}
        if live is not None:
            from kvplugin.cache.codec.quantize import matches_live

            keep = {i: layer for i, layer in enumerate(cache) if matches_live(layer, *live)}
        rest = [layer for i, layer in enumerate(cache) if i not in keep] if keep else cache
        restored = self.hook.kvplugin_dequantize_entry(cache=rest, settings=self.settings,
                                                       key_ropes=self.key_ropes)
        restored = rest if restored is None else restored
        if not keep:
            return restored
        with self._lock:
            self.counters.layers_handed_back_quantized += len(keep)
        it = iter(restored)
        return [keep[i] if i in keep else next(it) for i in range(len(cache))]

    # -- shut-down ----------------------------------------------------------------------------
    def close(self) -> None:
        """Shut-down: close the store (and its cold tier), then ``kvplugin_unconfigure``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.store.close()
        finally:
            if self._owns_configure:
                self.hook.kvplugin_unconfigure(settings=self.settings, host=self.host)

    def release_memory(self) -> int:
        """Hand MLX's buffer cache back to the system (after evictions and codec passes); counted."""
        from kvplugin.cache.memory.release import release_buffer_cache

        released = release_buffer_cache()
        with self._lock:
            self.counters.memory_releases += 1
            self.counters.bytes_released += released
        return released

    def _on_evict(self, entry: Any) -> None:
        self._event("evict", len(entry.tokens), entry.cache)
        self.hook.kvplugin_on_evict(entry=entry, settings=self.settings)


# --------------------------------------------------------------------------- host fallbacks

def store_key(host: str, fingerprint: str, settings: KVPluginSettings | None) -> str:
    """The store's model key for a checkpoint ``fingerprint`` served under ``settings``.

    The host and the bound are part of it: an entry built under another ``--max-kv-size`` (a
    rotating cache that dropped tokens, or an unbounded one) must not be served to this
    process, even from a cold tier that outlives the process or is shared.
    """
    bound = (settings.max_kv_size if settings is not None else None) or 0
    return f"{host}|{fingerprint}|max_kv={bound}"
