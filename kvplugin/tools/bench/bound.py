"""``kvplugin bench --bound``: what a ``--max-kv-size`` bound costs while it is not yet used.

Decode on a real model whose memory its KV cache dominates (the KV-heavy llama: 32 layers x
1 KV head x 64, float32, 16 KiB of KV per token), through mlx-lm's own ``generate_step``, at
several contexts inside several bounds, for three caches:

- ``stock growth``: mlx-lm's ``KVCache`` (unbounded; grows 256 slots at a time, every layer on
  the same step);
- ``stock rotating``: mlx-lm's ``RotatingKVCache(bound, keep=4)`` (what ``mlx_lm.generate
  --max-kv-size`` uses);
- ``kvplugin``: the bounded cache ``--max-kv-size`` gives (``bound_cache``: staggered growth).

Per case: decode tokens/s (median over rounds; the three caches take turns, in a rotating
order, on the same prefilled context) and its ratio to stock growth's as the median of each
round's ratio (paired: the load drifts between rounds, less within one), the worst decode step
over the median one, the bytes each cache holds, the live KV (the tokens it keeps) and the
largest MLX peak above what was held while decoding. Numbers, not a test: nothing here is
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("stock growth", "stock rotating", "kvplugin")


def _caches(variant: str, model: Any, bound: int) -> list:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvplugin.cache.bounded.prealloc import bound_cache

    n = len(model.layers)
    if variant == "stock growth":
        return [KVCache() for _ in range(n)]
    if variant == "stock rotating":
        return [RotatingKVCache(bound, keep=4) for _ in range(n)]
    return bound_cache([KVCache() for _ in range(n)], bound)[0]


def _held(cache: list) -> int:
    return sum(int(c.nbytes) for c in cache)


def _decode(model: Any, cache: list, token: int, steps: int) -> tuple[list[float], int]:
    """``steps`` decode steps continuing ``cache``; per-step seconds and the MLX peak growth."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    times, last = [], time.perf_counter()
    for _, _ in zip(range(steps + 1), generate_step(mx.array([token]), model,
                                                     prompt_cache=cache)):
        now = time.perf_counter()
        times.append(now - last)
        last = now
    mx.synchronize()
    return times[1:], int(mx.get_peak_memory()) - int(before)


def _prefill(model: Any, cache: list, context: int) -> tuple[float, int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = mx.array([(7 * i) % 1000 + 5 for i in range(context)])
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for _, _ in zip(range(1), generate_step(prompt, model, prompt_cache=cache,
                                            prefill_step_size=2048)):
        pass
    mx.synchronize()
    return time.perf_counter() - t0, int(mx.get_peak_memory()) - int(before)


def run_case(model: Any, context: int, bound: int, decode: int, rounds: int,
             per_token: int, stock_growth: tuple[list, float, int]) -> dict[str, Any]:
    """One context in one bound; ``stock_growth``: the context's unbounded cache, prefilled
    once per context (it does not depend on the bound), with its prefill time and peak."""
    caches: dict[str, list] = {}
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        if variant == "stock growth":
            cache, prefill_s, prefill_peak = stock_growth
        else:
            cache = _caches(variant, model, bound)
            prefill_s, prefill_peak = _prefill(model, cache, context)
        kept = min(context, bound) if variant != "stock growth" else context
        out[variant] = {"prefill_s": prefill_s, "prefill_peak_bytes": prefill_peak,
                        "held_bytes": _held(cache), "live_kv_bytes": kept * per_token,
                        "rounds": []}
        caches[variant] = cache
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for variant in order:
            times, peak = _decode(model, caches[variant], 5 + r, decode)
            out[variant]["rounds"].append({"tok_s": len(times) / sum(times),
                                           "median_ms": 1e3 * statistics.median(times),
                                           "worst_ms": 1e3 * max(times),
                                           "decode_peak_bytes": peak,
                                           "held_after_bytes": _held(caches[variant])})
    for variant, res in out.items():
        rs = res["rounds"]
        res["tok_s"] = statistics.median(r["tok_s"] for r in rs)
        res["worst_over_median"] = max(r["worst_ms"] / r["median_ms"] for r in rs)
        res["decode_peak_bytes"] = max(r["decode_peak_bytes"] for r in rs)
        res["held_after_bytes"] = rs[-1]["held_after_bytes"]
    stock_rounds = out["stock growth"]["rounds"]
    for res in out.values():
        # paired: each round's ratio to stock growth's run in the same round, then the median
        # (the machine's load drifts between rounds; within a round the caches take turns)
        ratios = sorted(r["tok_s"] / s["tok_s"] for r, s in zip(res["rounds"], stock_rounds))
        res["tok_s_vs_stock_growth"] = statistics.median(ratios)
        res["paired_ratio_range"] = (ratios[0], ratios[-1])
    return out


def _table(results: list[dict[str, Any]]) -> str:
    mib = 2 ** 20
    lines = ["| context | bound | cache | decode tok/s (x stock growth: paired median, range) | "
             "worst/median step | "
             "held MiB | live KV MiB | decode peak above held MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for case in results:
        for variant in VARIANTS:
            r = case["caches"][variant]
            lo, hi = r["paired_ratio_range"]
            lines.append(
                f"| {case['context']} | {case['bound']} | {variant} | {r['tok_s']:.1f} "
                f"({r['tok_s_vs_stock_growth']:.2f}x, {lo:.2f}-{hi:.2f}) | "
                f"{r['worst_over_median']:.2f} | "
                f"{r['held_bytes'] / mib:.1f} | {r['live_kv_bytes'] / mib:.1f} | "
                f"{r['decode_peak_bytes'] / mib:.1f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplugin bench --bound", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384",
                   help="prefilled context lengths (tokens, comma-separated)")
    p.add_argument("--bounds", default="4096,32768", help="--max-kv-size values")
    p.add_argument("--decode", type=int, default=32, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds per case")
    p.add_argument("--batched", action="store_true",
                   help="instead: a batch of two real-model requests decoding past the bound "
                        "(kvplugin.tools.bench.bound_batch)")
    p.add_argument("--out", type=Path, default=Path("bench-results/bound"),
                   help="where bound.json and bound.md go")
    return p


def _preloaded() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if sys.platform.startswith("linux") and not _preloaded():
        from kvplugin.tools import blas

        env = blas.preload_env()  # OpenBLAS or a loud error naming the package
        cmd = [sys.executable, "-m", "kvplugin.tools.bench.bound", *(argv or sys.argv[1:])]
        return subprocess.call(cmd, env={**os.environ, **env})
    if args.batched:
        return _batched(args)
    from mlx_lm import load

    from kvplugin.tools.models import kv_heavy

    model, _ = load(str(kv_heavy.build_kv_heavy_model()))
    per_token = 2 * kv_heavy.LAYERS * kv_heavy.HEAD_DIM * 4
    results = []
    for context in (int(c) for c in args.contexts.split(",")):
        growth = _caches("stock growth", model, 0)
        stock_growth = (growth, *_prefill(model, growth, context))
        for bound in (int(b) for b in args.bounds.split(",")):
            print(f"context {context}, bound {bound} ...", flush=True)
            results.append({"context": context, "bound": bound,
                            "caches": run_case(model, context, bound, args.decode,
                                               args.rounds, per_token, stock_growth)})
        del growth, stock_growth
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": "KV-heavy llama, 32 layers x 1 KV head x 64, float32 (random weights)",
            "produced_by": "kvplugin bench --bound (mlx-lm generate_step, MLX memory counters)",
            "openblas_preloaded": _preloaded(), "decode_steps": args.decode,
            "rounds": args.rounds}
    (args.out / "bound.json").write_text(json.dumps({"meta": meta, "results": results},
                                                    indent=1))
    table = _table(results)
    (args.out / "bound.md").write_text(table + "\n")
    print(table)
    print(f"\n{meta['produced_by']}; {meta['model']}; OpenBLAS preloaded: "
          f"{meta['openblas_preloaded']}; results in {args.out}")
    return 0


def _batched(args: argparse.Namespace) -> int:
    from kvplugin.tools.bench import bound_batch

    bound = int(args.bounds.split(",")[0])
    result = bound_batch.run(bound, args.decode, args.rounds)
    result["produced_by"] = ("kvplugin bench --bound --batched (SmolLM2-135M-Instruct float32, "
                             f"OpenBLAS preloaded: {_preloaded()})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bound_batched.json").write_text(json.dumps(result, indent=1))
    text = bound_batch.table(result)
    (args.out / "bound_batched.md").write_text(text + "\n")
    print(text)
    print(f"\n{result['produced_by']}; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
