"""The engine benchmark's growth workload: memory and decode-step latency while a cache fills.

Stock mlx-lm caches and kvplugin's pre-allocated ones take the same synthetic fp16 tokens; the
latency statistics isolate a cache's own work (growth, wrap-around) from scheduler noise.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Callable

from kvplugin.tools.bench.engine_cases import GOALS
from kvplugin.tools.bench.engine_measure import Geometry, MemoryMeter, mlx_core, random_fp16
from kvplugin.tools.bench.report import MiB, Progress, percentile

__all__ = ["growth_configs", "bench_growth"]


def _update_all(caches: list, k, v) -> list:
    """One update of every layer with the same new keys/values; returns what attention gets."""
    outs: list = []
    for c in caches:
        outs.extend(c.update_and_fetch(k, v))
    return outs


def _prefill_chunk(caches: list, chunk: list) -> None:
    for c, (k, v) in zip(caches, chunk):
        c.update_and_fetch(k, v)


def _downsample(xs: list, peaks: list, actives: list, max_points: int = 400) -> dict[str, list]:
    """At most ``max_points`` points; each keeps the *largest* peak of the steps it covers so
    that spikes survive, and the last active value."""
    n = len(xs)
    if n <= max_points:
        return {"step": list(xs), "peak_mib": [p / MiB for p in peaks],
                "active_mib": [a / MiB for a in actives]}
    w = math.ceil(n / max_points)
    out: dict[str, list] = {"step": [], "peak_mib": [], "active_mib": []}
    for i in range(0, n, w):
        out["step"].append(xs[min(i + w, n) - 1])
        out["peak_mib"].append(max(peaks[i:i + w]) / MiB)
        out["active_mib"].append(actives[min(i + w, n) - 1] / MiB)
    return out


def _latency_stats(lat_ms: list[float], alloc: list[bool]) -> dict[str, Any]:
    s = sorted(lat_ms)
    med = statistics.median(s)
    worst = s[-1]
    quiet = sorted(x for x, a in zip(lat_ms, alloc) if not a)
    over = [i for i, x in enumerate(lat_ms) if x > GOALS["worst_over_median"] * med]
    return {
        "steps": len(s),
        "median_ms": med,
        "mean_ms": statistics.fmean(s),
        "p90_ms": percentile(s, 90),
        "p99_ms": percentile(s, 99),
        "p999_ms": percentile(s, 99.9),
        "worst_ms": worst,
        "worst_step": lat_ms.index(worst),
        "worst_over_median": worst / med if med > 0 else float("inf"),
        "steps_over_3x_median": len(over),
        "alloc_steps": sum(alloc),
        "alloc_steps_over_3x_median": sum(1 for i in over if alloc[i]),
        "worst_after_first_over_median": (max(lat_ms[1:]) / med) if len(lat_ms) > 1 and med > 0
        else None,
        "first_step_ms": lat_ms[0],
        "worst_non_alloc_ms": quiet[-1] if quiet else None,
        "worst_non_alloc_over_median": (quiet[-1] / med) if quiet and med > 0 else None,
        "total_s": sum(s) / 1000.0,
    }


_Factory = Callable[[], list]


def growth_configs(tokens: int, layers: int) -> list[tuple[str, str, str, int, _Factory]]:
    """(name, kind, label, capacity in tokens, factory of a fresh per-request cache list)."""
    from kvplugin.cache.bounded import prealloc
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    half = max(tokens // 2, 8)
    return [
        ("stock_kvcache", "stock", "stock KVCache (step 256)", tokens,
         lambda: [KVCache() for _ in range(layers)]),
        ("stock_rotating", "stock", f"stock RotatingKVCache({tokens}, keep=4)", tokens,
         lambda: [RotatingKVCache(tokens, keep=4) for _ in range(layers)]),
        ("kvplugin_stepped", "kvplugin", f"kvplugin KVCache step={tokens} (--kv-cache-step)",
         tokens, lambda: prealloc.apply_growth_step([KVCache() for _ in range(layers)], tokens)),
        ("kvplugin_prealloc_rotating", "kvplugin",
         f"kvplugin bounded({tokens}), staggered growth (--max-kv-size)", tokens,
         lambda: prealloc.bound_cache([KVCache() for _ in range(layers)], tokens)[0]),
        ("stock_rotating_half", "stock", f"stock RotatingKVCache({half}, keep=4), wraps", half,
         lambda: [RotatingKVCache(half, keep=4) for _ in range(layers)]),
        ("kvplugin_prealloc_rotating_half", "kvplugin",
         f"kvplugin bounded({half}), wraps", half,
         lambda: prealloc.bound_cache([KVCache() for _ in range(layers)], half)[0]),
    ]


def bench_growth(geo: Geometry, tokens: int, prefill: int, repeats: int,
                 bar: Progress) -> dict[str, Any]:
    """Fill each config ``repeats`` times. Memory comes from the first run (it is the same in
    every run); latency is reported for the first run (``latency_raw``, everything the machine
    did included) and per step index as the minimum over the runs (``latency``): random
    scheduler/OS stalls rarely hit the same step twice, while a cache's own work (growth,
    wrap-around) recurs at the same steps every run, so the minimum isolates the cache."""
    mx = mlx_core()
    out: dict[str, Any] = {}
    tok_k = random_fp16((1, geo.kv_heads, 1, geo.head_dim), 7)
    tok_v = random_fp16((1, geo.kv_heads, 1, geo.head_dim), 8)
    mx.eval(tok_k, tok_v)
    alloc_threshold = max(64 << 10, 8 * geo.bytes_per_token)
    chunk_bytes = prefill * geo.bytes_per_token
    for name, kind, label, capacity, factory in growth_configs(tokens, geo.layers):
        bar.set_description(f"growth: {name}")
        runs_ms: list[list[float]] = []
        for rep in range(repeats):
            mem = MemoryMeter()
            caches = factory()
            # The prefill chunk's keys/values exist before the cache takes them (as a model's
            # projections do); they count in the prefill peak, their generation does not.
            chunk = [(random_fp16((1, geo.kv_heads, prefill, geo.head_dim), 100 + 2 * i),
                      random_fp16((1, geo.kv_heads, prefill, geo.head_dim), 101 + 2 * i))
                     for i in range(geo.layers)]
            mx.eval(chunk)
            mem.reset_peak()
            t0 = time.perf_counter()
            _prefill_chunk(caches, chunk)
            chunk = None
            mx.eval([c.state for c in caches])  # as mlx-lm's generate_step does after prefill
            prefill_s = time.perf_counter() - t0
            xs, peaks, actives = [prefill], [mem.peak()], [mem.active()]
            lat_ms: list[float] = []
            alloc: list[bool] = []
            gc_was = gc.isenabled()
            gc.disable()
            try:
                for step in range(prefill + 1, tokens + 1):
                    before = mem.active()
                    mem.reset_peak()
                    t = time.perf_counter_ns()
                    outs = _update_all(caches, tok_k, tok_v)
                    mx.eval(outs)
                    dt = time.perf_counter_ns() - t
                    outs = None
                    lat_ms.append(dt / 1e6)
                    if rep == 0:
                        p = mem.peak()
                        alloc.append(p - before > alloc_threshold)
                        xs.append(step)
                        peaks.append(p)
                        actives.append(mem.active())
                    bar.update()
            finally:
                if gc_was:
                    gc.enable()
            runs_ms.append(lat_ms)
            del caches
            if rep == 0:
                ideal = capacity * geo.bytes_per_token
                peak = max(peaks)
                r0 = {
                    "kind": kind,
                    "label": label,
                    "capacity_tokens": capacity,
                    "ideal_bytes": ideal,
                    "prefill_chunk_bytes": chunk_bytes,
                    "peak_bytes": peak,
                    "peak_over_ideal": peak / ideal,
                    "prefill_peak_bytes": peaks[0],
                    "decode_peak_bytes": max(peaks[1:]) if len(peaks) > 1 else None,
                    "held_bytes": actives[-1],
                    "held_over_ideal": actives[-1] / ideal,
                    "prefill_s": prefill_s,
                    "series": _downsample(xs, peaks, actives),
                    "_full_series": {"step": xs, "peak_mib": [p / MiB for p in peaks],
                                     "active_mib": [a / MiB for a in actives]},
                }
                alloc0 = alloc
        best = [min(v) for v in zip(*runs_ms)]
        r0["repeats"] = repeats
        r0["latency"] = _latency_stats(best, alloc0)
        r0["latency_raw"] = _latency_stats(runs_ms[0], alloc0)
        r0["_latency_ms"] = best
        out[name] = r0
    return out
