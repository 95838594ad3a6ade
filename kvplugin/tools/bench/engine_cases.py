"""The engine benchmark's goals and its store workloads: reuse, stored bytes, budget.

Each ``bench_*`` runs stock mlx-lm caches and kvplugin's side by side on synthetic fp16
data and returns plain numbers; :mod:`kvplugin.tools.bench.engine` runs them in order (the
growth workload is :mod:`kvplugin.tools.bench.engine_growth`).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any, Callable

from kvplugin.tools.bench.engine_measure import Geometry, MemoryMeter, mlx_core, random_fp16
from kvplugin.tools.bench.report import MiB, Progress

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


def _fill(caches: list, n: int, geo: Geometry, seed: int) -> None:
    """Prefill ``n`` tokens into every layer (fresh random data per layer) and evaluate the
    caches' state, as mlx-lm's ``generate_step`` does after each prefill chunk."""
    mx = mlx_core()
    for i, c in enumerate(caches):
        k = random_fp16((1, geo.kv_heads, n, geo.head_dim), seed + 2 * i)
        v = random_fp16((1, geo.kv_heads, n, geo.head_dim), seed + 2 * i + 1)
        c.update_and_fetch(k, v)
    mx.eval([c.state for c in caches])


# --------------------------------------------------------------------------- reuse


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
    tok_k = random_fp16((1, geo.kv_heads, 1, geo.head_dim), 11)
    tok_v = random_fp16((1, geo.kv_heads, 1, geo.head_dim), 12)
    turn_k = random_fp16((1, geo.kv_heads, turn, geo.head_dim), 13)
    turn_v = random_fp16((1, geo.kv_heads, turn, geo.head_dim), 14)
    mx.eval(tok_k, tok_v, turn_k, turn_v)

    mem = MemoryMeter()
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


# --------------------------------------------------------------------------- stored bytes


def bench_stored_bytes(geo: Geometry, n_entry: int, bar: Progress) -> dict[str, Any]:
    from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
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


# --------------------------------------------------------------------------- budget


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
            k = random_fp16((1, 1, n, small.head_dim), seed * 1000 + 2 * i)
            v = random_fp16((1, 1, n, small.head_dim), seed * 1000 + 2 * i + 1)
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


def attention_roundtrip_error(
    keys: Any, values: Any, bits: int, group_size: int, *, num_queries: int = 8
) -> float:
    """Relative L2 error of attention output caused by a quantize/dequantize round trip.

    ``keys``/``values`` are ``(B, H, S, D)``. A fixed-seed query block attends (no mask, fp32
    SDPA so that only quantization error is measured) once over the given keys/values and once
    over their dequantized versions; returns ``||o_q - o|| / ||o||``. Deterministic.
    """
    import math

    import mlx.core as mx

    from kvplugin.cache.codec.quantize import validate_bits_group

    validate_bits_group(bits, group_size)
    B, H, _, D = keys.shape
    q = mx.random.normal((B, H, num_queries, D), key=mx.random.key(0))
    scale = 1.0 / math.sqrt(D)

    def attend(k: mx.array, v: mx.array) -> mx.array:
        k, v = k.astype(mx.float32), v.astype(mx.float32)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    def roundtrip(x: mx.array) -> mx.array:
        parts = mx.quantize(x, group_size=group_size, bits=bits)
        return mx.dequantize(*parts, group_size=group_size, bits=bits)

    ref = attend(keys, values)
    got = attend(roundtrip(keys), roundtrip(values))
    err = mx.sqrt(mx.sum((got - ref) ** 2)) / mx.sqrt(mx.sum(ref**2))
    return float(err.item())
