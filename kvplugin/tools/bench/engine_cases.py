"""The engine benchmark's four workloads: growth, reuse, stored bytes, budget.

Each ``bench_*`` runs stock mlx-lm caches and kvplugin's side by side on synthetic fp16
data and returns plain numbers; :mod:`kvplugin.tools.bench.engine` runs them in order.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvplugin.tools.bench.report import MiB, Progress, fmt_bytes, percentile

#: The engine-level goals (limit values).
GOALS = {
    "transient_on_reuse": 1.05,  # peak / entry bytes
    "slack_tokens": 0,
    "ratio_8bit": 0.532,  # of trimmed fp16, group 64
    "ratio_4bit": 0.282,
    "worst_over_median": 3.0,  # decode step, with pre-allocation
}

BITS = (8, 6, 5, 4, 3, 2)
GROUPS = (32, 64, 128)

# --------------------------------------------------------------------------- helpers


def mlx_core():
    import mlx.core as mx

    return mx


class _Mem:
    """Bytes above a baseline taken at construction (after dropping MLX's buffer cache)."""

    def __init__(self) -> None:
        mx = mlx_core()
        gc.collect()
        mx.clear_cache()
        self.base = mx.get_active_memory()

    def active(self) -> int:
        return mlx_core().get_active_memory() - self.base

    def reset_peak(self) -> None:
        mlx_core().reset_peak_memory()

    def peak(self) -> int:
        mx = mlx_core()
        return max(mx.get_peak_memory(), mx.get_active_memory()) - self.base


@dataclass
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:  # K and V, every layer
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} head_dim, fp16 "
                f"({fmt_bytes(self.bytes_per_token)}/token)")


def _rand(shape: tuple[int, ...], seed: int):
    mx = mlx_core()
    return mx.random.normal(shape, dtype=mx.float16, key=mx.random.key(seed))


def _update_all(caches: list, k, v) -> list:
    """One update of every layer with the same new keys/values; returns what attention gets."""
    outs: list = []
    for c in caches:
        outs.extend(c.update_and_fetch(k, v))
    return outs


def _fill(caches: list, n: int, geo: Geometry, seed: int) -> None:
    """Prefill ``n`` tokens into every layer (fresh random data per layer) and evaluate the
    caches' state, as mlx-lm's ``generate_step`` does after each prefill chunk."""
    mx = mlx_core()
    for i, c in enumerate(caches):
        k = _rand((1, geo.kv_heads, n, geo.head_dim), seed + 2 * i)
        v = _rand((1, geo.kv_heads, n, geo.head_dim), seed + 2 * i + 1)
        c.update_and_fetch(k, v)
    mx.eval([c.state for c in caches])


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


# --------------------------------------------------------------------------- 1. growth


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
    tok_k = _rand((1, geo.kv_heads, 1, geo.head_dim), 7)
    tok_v = _rand((1, geo.kv_heads, 1, geo.head_dim), 8)
    mx.eval(tok_k, tok_v)
    alloc_threshold = max(64 << 10, 8 * geo.bytes_per_token)
    chunk_bytes = prefill * geo.bytes_per_token
    for name, kind, label, capacity, factory in growth_configs(tokens, geo.layers):
        bar.set_description(f"growth: {name}")
        runs_ms: list[list[float]] = []
        for rep in range(repeats):
            mem = _Mem()
            caches = factory()
            # The prefill chunk's keys/values exist before the cache takes them (as a model's
            # projections do); they count in the prefill peak, their generation does not.
            chunk = [(_rand((1, geo.kv_heads, prefill, geo.head_dim), 100 + 2 * i),
                      _rand((1, geo.kv_heads, prefill, geo.head_dim), 101 + 2 * i))
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


# --------------------------------------------------------------------------- 2. reuse


def _service(*, bits: int | None = None, group_size: int = 64, max_bytes: int = 1 << 62):
    """A real kvplugin ``KVService`` (hot tier only, quantization as asked, no threshold)."""
    from kvplugin.cache.service.service import KVService
    from kvplugin.plugins import get_plugin_manager
    from kvplugin.settings import KVPluginSettings

    settings = KVPluginSettings(
        kv_cache_quantization=bits is not None,
        kv_cache_quantization_bits=bits or 8,
        kv_cache_quantization_group_size=group_size,
        kv_cache_min_quantize_tokens=0,
        hot_cache_only=True,
        ssd_cache_dir=None,
    )
    return KVService(settings, host="bench", hook=get_plugin_manager().hook, max_bytes=max_bytes)


def _live_cache(geo: Geometry, n: int, seed: int) -> list:
    """What a host holds after serving ``n`` tokens: stock ``KVCache`` layers (step 256)."""
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in range(geo.layers)]
    _fill(caches, n, geo, seed)
    return caches


def _reuse_one(geo: Geometry, n_entry: int, scenario: str, path: str, turn: int,
               decode_after: int, bar: Progress) -> dict[str, Any]:
    """One reuse timeline. ``scenario``: ``resend`` (request = the stored tokens; the last one
    is fed again) or ``next_turn`` (request = stored tokens + ``turn`` new tokens).
    ``path``: ``stock`` (LRUPromptCache + deepcopy), ``kvplugin`` (KVService: trim at insert,
    move on fetch) or ``move_untrimmed`` (PromptStore move of the untrimmed live cache)."""
    from kvplugin.cache.store.prompt_store import PromptStore
    from mlx_lm.models.cache import LRUPromptCache, trim_prompt_cache

    mx = mlx_core()
    key = list(range(1, n_entry + 1))
    new = list(range(n_entry + 1, n_entry + 1 + turn))
    request = key if scenario == "resend" else key + new
    tok_k = _rand((1, geo.kv_heads, 1, geo.head_dim), 11)
    tok_v = _rand((1, geo.kv_heads, 1, geo.head_dim), 12)
    turn_k = _rand((1, geo.kv_heads, turn, geo.head_dim), 13)
    turn_v = _rand((1, geo.kv_heads, turn, geo.head_dim), 14)
    mx.eval(tok_k, tok_v, turn_k, turn_v)

    mem = _Mem()
    live = _live_cache(geo, n_entry, seed=200)
    if path == "stock":
        store: Any = LRUPromptCache(max_size=10)
        store.insert_cache("model", key, live)
    elif path == "kvplugin":
        store = _service()
        store.insert("model", key, live)
    else:
        store = PromptStore(max_bytes=1 << 62)
        store.insert("model", key, live)
    live = None
    gc.collect()
    mx.clear_cache()
    entry = mem.active()
    events, peaks, actives, times = ["stored"], [entry], [entry], [0.0]

    def record(label: str, fn: Callable[[], Any]) -> Any:
        mem.reset_peak()
        t = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t) * 1000)
        events.append(label)
        peaks.append(mem.peak())
        actives.append(mem.active())
        bar.update()
        return result

    def fetch():
        if path == "stock":
            cache, rest = store.fetch_nearest_cache("model", request)
            n = len(request) - len(rest)
            if n == len(request):  # exact hit: the host feeds the last token again
                trim_prompt_cache(cache, 1)
                n -= 1
            return cache, n
        return store.fetch("model", request)

    cache, n = record("fetch", fetch)
    if cache is None:
        raise RuntimeError(f"reuse bench: {path} missed its own entry")
    rest = len(request) - n

    def forward(k, v):
        def go():
            # Layer after layer, as a model's forward pass reaches them (layer i + 1 needs
            # layer i's output), so a layer's old buffer is released once it has grown. One
            # evaluation of every layer's update at once would keep all old buffers until the
            # end: a 2x transient no real server shows (measured with `kvplugin bench
            # --server --memory`), which made the up-front growth room look necessary.
            for c in cache:
                mx.eval(c.update_and_fetch(k, v))
        return go

    if rest == 1:
        record("re-feed 1 token", forward(tok_k, tok_v))
    else:
        if rest != turn:
            raise RuntimeError(f"reuse bench: expected {turn} tokens left, got {rest}")
        record(f"prefill {turn} new", forward(turn_k, turn_v))
    for i in range(decode_after):
        record(f"decode {i + 1}", forward(tok_k, tok_v))
    cache = None
    store = None
    first = 2  # index of the first update after the fetch
    return {
        "scenario": scenario,
        "path": path,
        "kind": "stock" if path == "stock" else "kvplugin",
        "entry_tokens": n_entry,
        "entry_bytes": entry,
        "tokens_reused": n,
        "handover_ms": times[1],
        "first_update_ms": times[first],
        "peak_bytes": max(peaks),
        "transient_ratio": max(peaks) / entry,
        "first_update_peak_ratio": max(peaks[1:first + 1]) / entry,  # fetch + first update
        "held_after_ratio": actives[-1] / entry,
        "series": {"events": events, "peak_mib": [p / MiB for p in peaks],
                   "active_mib": [a / MiB for a in actives], "entry_mib": entry / MiB,
                   "ms": times},
    }


REUSE_RUNS = [
    ("resend", "stock"),
    ("resend", "kvplugin"),
    ("next_turn", "stock"),
    ("next_turn", "kvplugin"),
    ("next_turn", "move_untrimmed"),
]

PATH_LABEL = {
    "stock": "stock deepcopy (LRUPromptCache)",
    "kvplugin": "kvplugin move (trimmed entry)",
    "move_untrimmed": "move, untrimmed entry (diagnostic)",
}


def bench_reuse(geo: Geometry, n_entry: int, turn: int, decode_after: int,
                bar: Progress) -> dict[str, Any]:
    out = {}
    for scenario, path in REUSE_RUNS:
        bar.set_description(f"reuse: {scenario}/{path}")
        out[f"{scenario}/{path}"] = _reuse_one(geo, n_entry, scenario, path, turn, decode_after,
                                               bar)
    return out


# --------------------------------------------------------------------------- 3. stored bytes


def bench_stored_bytes(geo: Geometry, n_entry: int, bar: Progress) -> dict[str, Any]:
    from kvplugin.cache.quantize import attention_roundtrip_error, dequantize_entry, quantize_entry
    from kvplugin.cache.layers import entry_nbytes
    from kvplugin.cache.layers.trim import trim_entry

    mx = mlx_core()
    live = _live_cache(geo, n_entry, seed=300)
    stock_bytes = entry_nbytes(live)
    slack_before = sum(c.keys.shape[2] - c.offset for c in live)
    t = time.perf_counter()
    trimmed = trim_entry(live)
    trim_ms = (time.perf_counter() - t) * 1000
    live = None
    gc.collect()
    fp16_bytes = entry_nbytes(trimmed)
    slack_after = sum(c.keys.shape[2] - c.offset for c in trimmed)
    formats = []
    for bits in BITS:
        for g in GROUPS:
            bar.set_description(f"stored bytes: {bits}-bit g{g}")
            row: dict[str, Any] = {"bits": bits, "group_size": g,
                                   "theory_ratio": bits / 16 + 2 / g}
            t = time.perf_counter()
            res = quantize_entry(trimmed, bits=bits, group_size=g)
            row["quantize_ms"] = (time.perf_counter() - t) * 1000
            row["layers_quantized"] = res.quantized
            row["layers_skipped"] = res.skipped
            row["bytes"] = entry_nbytes(res.cache)
            row["ratio_vs_fp16"] = row["bytes"] / fp16_bytes
            row["ratio_vs_stock_entry"] = row["bytes"] / stock_bytes
            if g == 64 and bits in (8, 4):  # the goals' widths (dequantizing fp16 is slow)
                t = time.perf_counter()
                back = dequantize_entry(res.cache)
                row["dequantize_ms"] = (time.perf_counter() - t) * 1000
                k0, r0 = trimmed[0].keys.astype(mx.float32), back[0].keys.astype(mx.float32)
                row["key_rel_l2"] = float(
                    (mx.sqrt(mx.sum((r0 - k0) ** 2)) / mx.sqrt(mx.sum(k0 ** 2))).item())
                back = None
            l0 = trimmed[0]
            row["attention_rel_l2"] = attention_roundtrip_error(l0.keys, l0.values, bits, g)
            res = None
            formats.append(row)
            bar.update()
    return {
        "entry_tokens": n_entry,
        "stock_entry_bytes": stock_bytes,
        "stock_slack_tokens": slack_before,
        "trimmed_fp16_bytes": fp16_bytes,
        "trim_ms": trim_ms,
        "slack_tokens_after_trim": slack_after,
        "trimmed_over_stock": fp16_bytes / stock_bytes,
        "formats": formats,
    }


# --------------------------------------------------------------------------- 4. budget


def bench_budget(geo: Geometry, tokens: int, budget_bytes: int, conversations: int, seed: int,
                 bar: Progress) -> dict[str, Any]:
    """Conversations kept in ``budget_bytes``. Simulated at 1 layer x 1 KV head with the budget
    divided by ``layers * kv_heads``: every format's bytes scale exactly linearly with both, so
    the counts are those of the full geometry at a fraction of the memory."""
    from mlx_lm.models.cache import KVCache, LRUPromptCache

    mx = mlx_core()
    scale = geo.layers * geo.kv_heads
    small = Geometry(layers=1, kv_heads=1, head_dim=geo.head_dim)
    budget_small = budget_bytes // scale
    rng = random.Random(seed)
    lo = max(16, tokens // 16)
    lengths = [rng.randint(lo, tokens) for _ in range(conversations)]

    def entries():
        for i, n in enumerate(lengths):
            c = KVCache()
            k = _rand((1, 1, n, small.head_dim), seed * 1000 + 2 * i)
            v = _rand((1, 1, n, small.head_dim), seed * 1000 + 2 * i + 1)
            c.update_and_fetch(k, v)
            mx.eval(c.state)
            yield [i + 1] + [7] * (n - 1), [c]  # unique first token: no prefix relations

    results: dict[str, Any] = {}
    lru = LRUPromptCache(max_size=1 << 30, max_bytes=budget_small)
    for toks, c in entries():
        lru.insert_cache("model", toks, c)
        bar.update()
    results["stock_fp16"] = {"label": "stock LRUPromptCache, fp16 live entries (slack kept)",
                             "kind": "stock", "entries": len(lru), "bytes": lru.nbytes * scale}
    lru = None
    for name, bits, label in (("kvplugin_fp16", None, "kvplugin, trimmed fp16"),
                              ("kvplugin_8bit", 8, "kvplugin, 8-bit g64"),
                              ("kvplugin_4bit", 4, "kvplugin, 4-bit g64")):
        svc = _service(bits=bits, max_bytes=budget_small)
        for toks, c in entries():
            svc.insert("model", toks, c)
            bar.update()
        st = svc.store.stats()
        results[name] = {"label": label, "kind": "kvplugin", "entries": st.entries,
                         "bytes": st.bytes * scale}
        svc = None
    stock_n = results["stock_fp16"]["entries"]
    for r in results.values():
        r["vs_stock"] = r["entries"] / stock_n if stock_n else None
    return {
        "budget_bytes": budget_bytes,
        "conversations": conversations,
        "length_range": [lo, tokens],
        "mean_length": statistics.fmean(lengths),
        "simulated_at": "1 layer x 1 KV head, budget / (layers x kv_heads)",
        "stores": results,
    }
