"""Engine-level benchmark: stock mlx-lm KV caches vs kvplugin's, synthetic data, one run.

``kvplugin bench`` (engine part) / ``python -m kvplugin.tools.bench.engine``. No model, no server:
random fp16 keys/values of a configurable geometry go through the real cache classes, the
real stock ``LRUPromptCache`` and the real kvplugin ``KVService``/``PromptStore``. Measures

1. **growth**: memory while filling ``--tokens`` tokens (one prefill chunk, then one-token
   decode updates) for stock ``KVCache`` (step 256) and ``RotatingKVCache`` vs kvplugin's
   pre-allocated caches (``apply_growth_step``/``bound_cache``, as ``--kv-cache-step`` and
   ``--max-kv-size`` build them), and the decode-step latency distribution of each;
2. **reuse**: memory when a stored entry is reused: stock ``LRUPromptCache.fetch_nearest_cache``
   (``copy.deepcopy``) vs kvplugin ``KVService.fetch`` (trimmed at insert, moved out on fetch),
   then the host's next update(s);
3. **stored bytes** of one entry: stock (with the live cache's spare slots), trimmed fp16, and
   quantized at every bit width and group size;
4. **conversations held** in a fixed byte budget: stock ``LRUPromptCache(max_bytes=...)`` vs
   kvplugin's store with fp16 / 8-bit / 4-bit entries.

Memory is MLX's own allocator accounting (``mx.get_active_memory``/``get_peak_memory``),
which works on CPU and Metal; the numbers are bytes above a baseline taken at the start of
each measurement. Latencies are wall-clock per decode update of all layers, evaluated
together (as a model's forward pass is); on a shared CPU they include scheduler noise.

Output: tables with the goals marked met/missed, ``engine.json`` and PNG plots in
``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvplugin.tools.bench.engine_cases import (
    BITS,
    GOALS,
    GROUPS,
    REUSE_RUNS,
    bench_budget,
    bench_reuse,
    bench_stored_bytes,
)
from kvplugin.tools.bench.engine_growth import bench_growth, growth_configs
from kvplugin.tools.bench.engine_measure import Geometry, mlx_core
from kvplugin.tools.bench.engine_report import format_tables, judge_goals, make_plots, strip_private
from kvplugin.tools.bench.report import Goal, MiB, Progress, environment, goals_table, save_results

__all__ = ["main", "build_parser", "run", "GOALS"]

DEFAULTS = dict(repeats=3, tokens=4096, prefill=512, layers=8, kv_heads=8, head_dim=128, turn=64,
                decode_after=16, budget_mib=1024, conversations=96)
QUICK = dict(repeats=2, tokens=512, prefill=128, layers=2, kv_heads=2, head_dim=128, turn=32,
             decode_after=8, budget_mib=4, conversations=48)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every section; returns the full result dict (with private plot data)."""
    mx = mlx_core()
    mx.random.seed(args.seed)
    geo = Geometry(args.layers, args.kv_heads, args.head_dim)
    n_entry = args.entry_tokens or max(args.tokens - 96, args.tokens * 3 // 4)
    res: dict[str, Any] = {
        "config": {
            "tokens": args.tokens, "prefill": args.prefill, "layers": args.layers,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "float16",
            "bytes_per_token": geo.bytes_per_token, "geometry": geo.describe(),
            "entry_tokens": n_entry, "turn": args.turn, "decode_after": args.decode_after,
            "budget_bytes": args.budget_mib * MiB, "conversations": args.conversations,
            "seed": args.seed, "quick": args.quick, "repeats": args.repeats,
        },
        "environment": environment(),
        "goal_limits": GOALS,
    }
    n_growth = (len(growth_configs(args.tokens, args.layers)) * (args.tokens - args.prefill)
                * args.repeats)
    n_reuse = len(REUSE_RUNS) * (2 + args.decode_after)
    total = n_growth + n_reuse + len(BITS) * len(GROUPS) + 4 * args.conversations
    t0 = time.perf_counter()
    with Progress(total, "engine bench", enabled=args.progress) as bar:
        res["growth"] = bench_growth(geo, args.tokens, args.prefill, args.repeats, bar)
        res["reuse"] = bench_reuse(geo, n_entry, args.turn, args.decode_after, bar)
        res["stored_bytes"] = bench_stored_bytes(geo, n_entry, bar)
        res["budget"] = bench_budget(geo, args.tokens, args.budget_mib * MiB, args.conversations,
                                     args.seed, bar)
    res["elapsed_s"] = time.perf_counter() - t0
    res["goals"] = [g.to_dict() for g in judge_goals(res)]
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplugin bench",
        description="Engine-level benchmark: stock mlx-lm KV caches vs kvplugin (synthetic).",
    )
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens to fill (default {DEFAULTS['tokens']}; quick {QUICK['tokens']})")
    p.add_argument("--prefill", type=int, default=None, help="first chunk size (default 512)")
    p.add_argument("--layers", type=int, default=None, help="default 8")
    p.add_argument("--kv-heads", type=int, default=None, help="default 8")
    p.add_argument("--head-dim", type=int, default=None,
                   help="default 128 (group sizes 32/64/128 must divide it)")
    p.add_argument("--entry-tokens", type=int, default=None,
                   help="tokens of the stored entry in the reuse/bytes sections "
                        "(default: tokens - 96, e.g. 4000 of 4096 slots)")
    p.add_argument("--turn", type=int, default=None,
                   help="new tokens of the next turn in the reuse section (default 64)")
    p.add_argument("--decode-after", type=int, default=None,
                   help="decode steps recorded after the reuse (default 16)")
    p.add_argument("--budget-mib", type=int, default=None,
                   help="byte budget of the conversations section (default 1024 MiB)")
    p.add_argument("--conversations", type=int, default=None, help="default 96")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each fill; step latency is the per-step minimum over them, "
                        "which removes random machine stalls but keeps the cache's own "
                        "spikes (default 3; quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("kvplugin-bench"),
                   help="directory for engine.json and the PNG plots (default ./kvplugin-bench)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (a few seconds; used by the tests)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.tokens < 16 or not 1 <= args.prefill < args.tokens:
        raise SystemExit("kvplugin bench: need --tokens >= 16 and 1 <= --prefill < --tokens")
    if args.repeats < 1:
        raise SystemExit("kvplugin bench: need --repeats >= 1")
    if args.head_dim % 32:
        raise SystemExit("kvplugin bench: --head-dim must be a multiple of 32 "
                         "(quantization groups 32/64/128 must divide it)")
    if args.entry_tokens is not None and not 2 <= args.entry_tokens <= args.tokens:
        raise SystemExit("kvplugin bench: need 2 <= --entry-tokens <= --tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _resolve(build_parser().parse_args(argv))
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as e:
        print(f"kvplugin bench needs mlx and mlx-lm: {e}", file=sys.stderr)
        return 2
    res = run(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    res["plots"] = make_plots(res, out) if args.plots else {}
    cfg = res["config"]
    print(f"kvplugin engine bench - {cfg['geometry']}, {cfg['tokens']} tokens, "
          f"device {res['environment'].get('mlx_device', '?')} "
          f"({res['environment'].get('cpu_count')} CPUs), {res['elapsed_s']:.0f} s\n")
    print(format_tables(res))
    print()
    print(goals_table([Goal(**{k: v for k, v in g.items() if k not in ("verdict", "met")})
                       for g in res["goals"]]))
    save_results(out / "engine.json", strip_private(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
