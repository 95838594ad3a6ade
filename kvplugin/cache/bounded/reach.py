"""What ``--max-kv-size`` and ``--kv-cache-step`` reach of a fresh cache, and the one line
that says what they do not.

Why a module of its own: the rules are :func:`~kvplugin.cache.bounded.prealloc.bound_cache`'s
and :func:`~kvplugin.cache.bounded.prealloc.apply_growth_step`'s, and the service describes
the cache a host will run with the same rules, whichever plugin shaped it.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

__all__ = ["STEPPED", "reach_notice", "unbounded_kinds", "unstepped_kinds"]

#: the layer classes whose growth ``step`` kvplugin sets (exact classes, not subclasses)
STEPPED = (KVCache, QuantizedKVCache)


def unbounded_kinds(cache: list, max_kv_size: int) -> dict[str, int]:
    """Layer kind -> how many layers of ``cache`` can still grow beyond ``max_kv_size``
    tokens: not a rotating cache within the bound, nor fixed-size recurrent state."""
    kinds: dict[str, int] = {}
    for layer in cache:
        if isinstance(layer, RotatingKVCache) and layer.max_size <= max_kv_size:
            continue
        if isinstance(layer, ArraysCache):
            continue
        kinds[type(layer).__name__] = kinds.get(type(layer).__name__, 0) + 1
    return kinds


def unstepped_kinds(cache: list) -> list[str]:
    """The layer kinds of ``cache`` whose growth ``--kv-cache-step`` leaves to mlx-lm."""
    return sorted({type(layer).__name__ for layer in cache if type(layer) not in STEPPED})


def reach_notice(settings: Any, model: Any, cache: list) -> str | None:
    """The layers of ``model``'s shaped ``cache`` that still grow as its own code makes them,
    in one line naming the flag (None: the settings reach every layer)."""
    of = type(model).__module__
    n = settings.max_kv_size
    if n is not None:
        loose = unbounded_kinds(cache, n)
        if not loose:
            return None
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(loose.items()))
        return (f"--max-kv-size {n}: {len(cache) - sum(loose.values())} of {len(cache)} cache "
                f"layers of {of} are bounded; {kinds} are not plain KV caches and still grow "
                f"with the context")
    other = unstepped_kinds(cache) if settings.kv_cache_step is not None else []
    if not other:
        return None
    return (f"--kv-cache-step {settings.kv_cache_step} applies to KVCache layers only; "
            f"{', '.join(other)} layers of {of} keep mlx-lm's growth")
