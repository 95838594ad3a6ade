"""``--continuous-batching``: the scheduler's prefix cache is backed by kvplugin's session.

``vllm_mlx.scheduler.MemoryAwarePrefixCache`` (a by-name import used only by
``Scheduler.__init__``) is replaced by a subclass whose store/fetch/persistence go through
the process's ``KVService`` and which keeps the private fields the scheduler reads
(``_entries``, ``_current_memory``, ``_last_match_type``, ``_last_matched_key``). Budget: the
host's ``MemoryCacheConfig.compute_memory_limit()`` (``--cache-memory-mb`` /
``--cache-memory-percent``). ``Scheduler.ensure_ssd_tier`` becomes a no-op for it (kvplugin's
cold tier is ``--ssd-cache-dir``). ``--max-kv-size``: every request's fresh cache is the session's
(``KVService.make_cache``: ``RotatingKVCache(n, keep=4)`` layers, as in the default mode), built
where vllm-mlx builds its own (``Scheduler._bound_cache_layers`` in 0.6, mlx-lm's
``BatchGenerator._make_new_cache`` otherwise), so the batch merges them into kvplugin's
``KeepingBatchRotatingKVCache`` and a request answers the same in both modes. The batch
caches grow by the class ``step`` the session decides.

Persistence: the host's shut-down save / start-up load of the prefix cache are
``KVService.persist``/``restore`` on kvplugin's own subdirectory. When the session allows no
persistence (``--hot-cache-only``), ``BatchedEngine``'s save/load are no-ops.
"""

from __future__ import annotations

import threading
from typing import Any

from kvplugin.hosts.base import PatchRegistry, require_attrs, wraps_original
from kvplugin.hosts.vllm_mlx.salt import UNKNOWN, owner_salt, request_salt
from kvplugin.log import say

_MB = 1024 * 1024


def check_seams(scheduler: Any, memory_cache: Any, batched: Any, mlc: Any) -> None:
    """Fail closed: every seam of this mode present, with the expected shape."""
    require_attrs(scheduler, "MemoryAwarePrefixCache", "Scheduler")
    require_attrs(scheduler.Scheduler, "ensure_ssd_tier")
    if scheduler.MemoryAwarePrefixCache is not memory_cache.MemoryAwarePrefixCache:
        raise TypeError("vllm_mlx.scheduler.MemoryAwarePrefixCache is not memory_cache's")
    require_attrs(memory_cache, "MemoryCacheConfig", "_detach_cache_for_storage")
    require_attrs(memory_cache.MemoryCacheConfig, "compute_memory_limit")
    require_attrs(batched, "BatchedEngine")
    require_attrs(batched.BatchedEngine, "save_cache_to_disk", "load_cache_from_disk")
    require_attrs(mlc, "BatchKVCache", "BatchRotatingKVCache", "KVCache", "make_prompt_cache")
    require_attrs(mlc.BatchKVCache, "merge", "filter", "extract")


def install(patches: PatchRegistry, adapter: Any, scheduler: Any, memory_cache: Any,
            batched: Any, mlc: Any) -> None:
    """Patch this mode's seams (after :func:`check_seams`; the session exists)."""
    rt = adapter.runtime
    cls = bind_prefix_cache(memory_cache, adapter)
    patches.replace(scheduler, "MemoryAwarePrefixCache", cls)
    sched = scheduler.Scheduler
    patches.replace(sched, "ensure_ssd_tier", wrap_ensure_ssd_tier(sched.ensure_ssd_tier))
    if rt.mode == "batching":  # the batch caches every request is merged into
        plan = rt.service.batch_plan()
        for name, step in plan.steps.items():
            patches.replace(getattr(mlc, name), "step", step)
        install_batch_of_one(patches, mlc)
        if hasattr(sched, "SNAPSHOT_REFRESH_TOKENS"):
            # The host re-snapshots an entry that cannot be trimmed (sliding windows) only
            # after this many new tokens, since its hit left the old one in place; a hit on
            # kvplugin's store moves the entry out, so every turn's snapshot must come back.
            patches.replace(sched, "SNAPSHOT_REFRESH_TOKENS", 0)
        if plan.bound is not None:
            install_bound(patches, rt.service, sched, mlc)
    if not rt.service.may_persist():
        be = batched.BatchedEngine
        for name, result in (("save_cache_to_disk", False), ("load_cache_from_disk", 0),
                             ("_save_cache_to_disk_on_owner", False),
                             ("_load_cache_from_disk_on_owner", 0)):
            if hasattr(be, name):  # the last two: the async forms of newer releases
                patches.replace(be, name, refusing(getattr(be, name), result))


def install_bound(patches: PatchRegistry, service: Any, sched: type, mlc: Any) -> None:
    """Fresh per-request caches come from the session, wherever vllm-mlx makes them.

    Why both seams: vllm-mlx 0.6 bounds a fresh cache itself (``_bound_cache_layers``, also
    its reference for which restored entries match the bound); any sequence inserted without
    a cache gets mlx-lm's ``BatchGenerator._make_new_cache``. Both would build
    ``RotatingKVCache(n)`` keeping no first tokens.
    """
    import importlib

    gen = importlib.import_module("mlx_lm.generate")  # the package's `generate` is a function

    def fresh(model: Any) -> list:
        return service.make_cache(model, mlc.make_prompt_cache(model))

    require_attrs(gen.BatchGenerator, "_make_new_cache")
    if hasattr(sched, "_bound_cache_layers"):
        @wraps_original(sched._bound_cache_layers)
        def _bound_cache_layers(self: Any, cache: Any, max_kv_size: int) -> Any:
            return fresh(self.model)

        patches.replace(sched, "_bound_cache_layers", _bound_cache_layers)

    @wraps_original(gen.BatchGenerator._make_new_cache)
    def _make_new_cache(self: Any) -> list:
        return fresh(self.model)

    patches.replace(gen.BatchGenerator, "_make_new_cache", _make_new_cache)


def install_batch_of_one(patches: PatchRegistry, mlc: Any) -> None:
    """``BatchKVCache`` merge/filter/extract without their whole-cache copies for one row."""
    from kvplugin.hosts.mlx_lm.batch import adopting_extract, adopting_merge, whole_batch_filter

    cls = mlc.BatchKVCache
    own = vars(cls)
    patches.replace(cls, "merge", adopting_merge(own["merge"].__func__, mlc.KVCache))
    patches.replace(cls, "filter", whole_batch_filter(own["filter"]))
    patches.replace(cls, "extract", adopting_extract(own["extract"], mlc.KVCache))


def bind_prefix_cache(memory_cache: Any, adapter: Any) -> type:
    """``KVPrefixCache`` bound to the host's base class and to ``adapter``.

    Why a class is built here at all: the scheduler constructs the prefix cache itself, as
    ``MemoryAwarePrefixCache(model, config)``, and other host code checks
    ``isinstance(..., MemoryAwarePrefixCache)``, so what is patched in must be a subclass of
    vllm-mlx's class, which exists only once ``vllm_mlx.memory_cache`` is imported (stage 2).
    Everything it does is the module-level :class:`KVPrefixCache`; the built subclass only
    adds the host base and the class attributes the scheduler's constructor call cannot pass.
    """
    host_cls = memory_cache.MemoryAwarePrefixCache
    return type("KVPrefixCache", (KVPrefixCache, host_cls), {
        "__module__": __name__,
        "_host_memory_cache": memory_cache,
        "_adapter": adapter,
    })


class _Sized:
    """Stands in for ``MemoryAwarePrefixCache._entries`` (the scheduler only takes ``len``)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return len(self._owner)

    def __bool__(self) -> bool:
        return len(self) > 0


class KVPrefixCache:
    """``MemoryAwarePrefixCache`` whose entries live in kvplugin's store (a mixin: use
    :func:`bind_prefix_cache`, which puts the host class behind it).

    * ``store`` keys an entry by the tokens its cache really holds (``offset``), trims it,
      quantizes it per kvplugin's settings and hands it to the store (no extra copy of
      layers trim/quantize already copied; others are detached like the host does). The
      session learns where the prompt ended from the fetch, so the conversation's previous
      turn is superseded.
    * ``fetch`` is the store's longest-prefix lookup: a prefix entry is *moved* to the
      request (no copy; a batch of one adopts it), a shared prefix of another entry is
      served as views of it (the batch grows into a new buffer); at least one token is
      always left to prefill, so the scheduler never hits its exact-match re-prefill path. Quantized entries come
      back dequantized.
    * Below the host's ``min_prefix_tokens`` (128) nothing is stored or fetched, as stock.
    """

    kvplugin = True
    _host_memory_cache: Any = None  # vllm_mlx.memory_cache (set by bind_prefix_cache)
    _adapter: Any = None  # the VllmMlxAdapter whose runtime holds the session

    def __init__(self, model: Any, config: Any = None) -> None:  # no super(): no host state
        rt = self._adapter.runtime
        self._config = config or self._host_memory_cache.MemoryCacheConfig()
        self._service = rt.service
        self._key = rt.model_key(model)
        self._min_tokens = int(getattr(self._config, "min_prefix_tokens", 1) or 1)
        self._last_match_type: str | None = None
        self._last_matched_key: tuple | None = None
        self._ssd_tier = None
        self._model_id = id(model)
        self._model = model  # the scheduler's own: fetched entries are checked against it
        self._scheduler: Any = None  # weakref to the scheduler (salt.owner_salt reads it)
        self._memory_lock = threading.RLock()
        self._rejections = 0
        self._adapter.check_model(model, hard=True)
        from mlx_lm.models.cache import make_prompt_cache

        fresh = make_prompt_cache(model)
        self._service.learn_model(model, fresh)
        if self._adapter.runtime.mode == "batching" and coverage_unknown(fresh):
            say("vllm-mlx --continuous-batching keeps no prefix-cache entry of a model whose "
                "every layer is recurrent state (its scheduler cannot tell how many tokens "
                "that state covers); this model's requests reuse nothing, as stock",
                key="vllm-mlx:recurrent-only")

    # -- what the scheduler reads directly -------------------------------------------
    @property
    def _entries(self) -> _Sized:
        return _Sized(self)

    @property
    def _current_memory(self) -> int:
        return self._service.bytes_held

    @property
    def _max_memory(self) -> int:
        return self._service.budget_bytes

    def __len__(self) -> int:
        return self._service.entries_held

    def __contains__(self, tokens: Any) -> bool:
        return False  # the store has no lookup without taking the entry

    # -- fetch / store -----------------------------------------------------------------
    def fetch(self, tokens: list[int]) -> tuple[list | None, list[int]]:
        self._last_matched_key = None
        if not tokens or len(tokens) < self._min_tokens:
            self._last_match_type = "miss"
            return None, tokens
        try:
            key = self._service.salted_key(self._key, request_salt())
            cache, n = self._service.fetch(key, tokens, model=self._model)
        except Exception as exc:
            say(f"prefix-cache fetch failed ({type(exc).__name__}: {exc})", key="fetch-failed")
            cache, n = None, 0
        if cache is None:
            self._last_match_type = "miss"
            return None, tokens
        eval_entry(cache)
        self._last_match_type = "prefix"
        self._last_matched_key = tuple(tokens[:n])
        return cache, list(tokens[n:])

    def store(self, tokens: list[int], cache: list, evict_prefixes: bool = True) -> bool:
        prepared = self.prepare_store(tokens, cache)
        return prepared is not None and self.commit_prepared(prepared)

    def prepare_store(self, tokens: list[int], cache: list, auxiliary: Any = None) -> Any:
        if auxiliary or not tokens or not cache:
            return None
        try:
            scheduler = self._scheduler() if self._scheduler is not None else None
            salt = owner_salt(scheduler, tokens, cache)
            if salt is UNKNOWN:  # never stored where another request's salt could find it
                self._rejections += 1
                say("a prefix-cache entry could not be matched to one request's cache_salt "
                    "(requests of two salts hold the same tokens); not stored",
                    key="vllm-mlx:store-unknown-salt")
                return None
            model_key = self._service.salted_key(self._key, salt)
            prepared = self._service.prepare_finished(model_key, tokens, list(cache),
                                                      min_tokens=self._min_tokens)
            if prepared is None:
                return None
            key, entry = prepared
            return (tuple(key), detach_shared_layers(entry, cache, self._host_memory_cache),
                    model_key)
        except Exception as exc:
            self._rejections += 1
            say(f"prefix-cache store failed ({type(exc).__name__}: {exc})", key="store-failed")
            return None

    def commit_prepared(self, entry: Any, evict_prefixes: bool = True, *, commit_lock: Any = None,
                        commit_guard: Any = None) -> bool:
        if entry is None:
            return False
        if commit_guard is not None and not commit_guard():
            return False
        tokens, cache, key = entry
        ok = self._service.store_prepared(key, tokens, cache)
        if not ok:
            self._rejections += 1
        return ok

    def clone_for_replay(self, cache: list) -> list | None:
        try:
            return self._host_memory_cache._detach_cache_for_storage(cache)
        except Exception:
            return None

    def fetch_exact_auxiliary(self, tokens: list[int]) -> None:
        return None

    def remove(self, tokens: list[int], *, include_ssd: bool = False) -> bool:
        return False  # fetched entries are already out of the store; others expire by LRU

    def clear(self) -> None:
        self._service.drop_all()  # drop, don't spill

    # -- stats -------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        s = self._service.store_stats()
        total = s.hits + s.misses
        limit = self._service.budget_bytes
        return {
            "hits": s.hits,
            "misses": s.misses,
            "hit_rate": round(s.hits / total, 4) if total else 0.0,
            "evictions": s.evictions,
            "tokens_saved": s.tokens_reused,
            "current_memory_mb": round(s.bytes / _MB, 2),
            "max_memory_mb": round(limit / _MB, 2),
            "memory_utilization": round(s.bytes / limit, 4) if limit else 0.0,
            "entry_count": s.entries,
            "store_rejections": s.rejected + self._rejections,
            "backend": "kvplugin",
        }

    def reset_stats(self) -> None:
        return None

    @property
    def memory_usage_mb(self) -> float:
        return self._service.bytes_held / _MB

    @property
    def memory_limit_mb(self) -> float:
        return self._service.budget_bytes / _MB

    # -- the host's SSD tier is not used (kvplugin's cold tier is) ----------------------
    def try_reserve_memory(self, nbytes: int) -> bool:
        return False

    def release_reserved_memory(self, nbytes: int) -> None:
        return None

    def set_ssd_tier(self, ssd_tier: Any) -> None:
        self._ssd_tier = None

    def check_ssd(self, tokens: list[int]) -> None:
        return None

    # -- persistence ---------------------------------------------------------------------
    def save_to_disk(self, cache_dir: str) -> bool:
        from kvplugin.cache.service.persist import persist_dir  # lazy: mlx loads with the engine

        return self._service.persist(persist_dir(cache_dir))

    def load_from_disk(self, cache_dir: str) -> int:
        from kvplugin.cache.service.persist import persist_dir  # lazy: mlx loads with the engine

        return self._service.reload(persist_dir(cache_dir))


def coverage_unknown(cache: list) -> bool:
    """True where no layer holds a token count (``offset``): the scheduler then stores no
    entry at all (it keys entries by the tokens a cache covers), so there is nothing to back."""
    import importlib

    scheduler = importlib.import_module("vllm_mlx.scheduler").Scheduler
    coverage = getattr(scheduler, "_cache_coverage", None)
    if coverage is None:
        return False
    return coverage(cache) is None


def eval_entry(cache: list) -> None:
    """Evaluate a fetched entry here (a dequantized one is lazy) so no graph crosses threads."""
    import mlx.core as mx

    from kvplugin.cache.layers import entry_arrays

    arrays = entry_arrays(cache)
    if arrays:
        mx.eval(arrays)


def detach_shared_layers(entry: list, source: list, memory_cache: Any) -> list:
    """Layers trim/quantize returned unchanged may still view the live batch: copy those."""
    same = [i for i, (a, b) in enumerate(zip(entry, source)) if a is b]
    if not same:
        return entry
    detached = memory_cache._detach_cache_for_storage([entry[i] for i in same])
    out = list(entry)
    for i, layer in zip(same, detached):
        out[i] = layer
    return out


def wrap_ensure_ssd_tier(original: Any) -> Any:
    @wraps_original(original)
    def ensure_ssd_tier(self, *args, **kwargs):
        if getattr(getattr(self, "memory_aware_cache", None), "kvplugin", False):
            return None  # kvplugin's store has its own cold tier (--ssd-cache-dir)
        return original(self, *args, **kwargs)

    return ensure_ssd_tier


# -- BatchedEngine's save/load when the session allows no persistence (--hot-cache-only) ---


def refusing(original: Any, result: Any) -> Any:
    """``original`` (a save or load of ``BatchedEngine``, plain or async) doing nothing and
    answering ``result`` (nothing saved / loaded)."""
    import inspect

    if inspect.iscoroutinefunction(original):
        @wraps_original(original)
        async def refused_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            return result

        return refused_async

    @wraps_original(original)
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        return result

    return refused
