"""What ``kvplugin demo`` tells the user: its numbers summarised and printed, stock beside
kvplugin, apart from the code that starts servers and holds the conversation."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

from kvplugin.tools.client import STATS_PATH
from kvplugin.tools.console import KiB, MiB

__all__ = ["summarize", "format_report"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _speedup(cold: float | None, warm: float | None) -> float | None:
    if not cold or not warm:
        return None
    return cold / warm


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    if abs(n) >= MiB:
        return f"{n / MiB:.2f} MiB"
    if abs(n) >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{n:.0f} B"


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """The figures the report prints, from a run's numbers (also the ``--json`` summary)."""
    stats = result["stats"]
    turns = result["turns"]
    entries = stats.get("entries")
    held_dense = sum(e.get("dense_nbytes", 0) for e in entries) if entries else None
    held_tokens = sum(e.get("tokens", 0) for e in entries) if entries else None
    cold_stream = turns[0]["ttft_s"] if turns else None
    warm_stream = _median([t["ttft_s"] for t in turns[1:]])
    one = result["one_token"]
    return {
        "entries_stored": stats.get("entries_stored", 0),
        "entries_quantized": stats.get("entries_quantized", 0),
        "hits": stats.get("store_hits", 0),
        "misses": stats.get("store_misses", 0),
        "tokens_reused": stats.get("store_tokens_reused", 0),
        "entries_held": stats.get("store_entries"),
        "held_tokens": held_tokens,
        "held_bytes_fp16": held_dense,
        "held_bytes_stored": stats.get("store_bytes"),
        "host_bytes": stats.get("bytes_before"),
        "stored_bytes": stats.get("bytes_stored"),
        "system_prompt_tokens": (turns[0]["prompt_tokens"] if turns else None),
        "ttft_stream_cold_s": cold_stream,
        "ttft_stream_warm_s": warm_stream,
        "ttft_stream_speedup": _speedup(cold_stream, warm_stream),
        "ttft_1tok_cold_s": one["cold"]["ttft_s"],
        "ttft_1tok_warm_s": one["warm"]["ttft_s"],
        "ttft_1tok_speedup": _speedup(one["cold"]["ttft_s"], one["warm"]["ttft_s"]),
        "side_by_side": {name: _row(result[name], result.get("budget_bytes"),
                                    _in_budget(result, "bytes_fp16" if name == "stock" else "bytes"))
                         for name in ("stock", "kvplugin") if name in result},
        "policy": result.get("policy", "always"),
        "demotions": stats.get("demotions", 0),
        "hits_full": stats.get("hits_full", 0),
        "hits_demoted": stats.get("hits_demoted", 0),
    }


def _in_budget(result: Mapping[str, Any], key: str) -> list[int]:
    """Conversations the budget holds, once per repeat: the budget over what the store held
    for that conversation (``bytes``: as stored; ``bytes_fp16``: the same entries at full
    precision, the least a store of stock's full-precision entries holds for it)."""
    budget = result.get("budget_bytes")
    held = [h.get(key) for h in result.get("held") or () if h]
    return [int(budget // b) for b in held if budget and b and b > 0]


def _row(run: Mapping[str, Any], budget: int | None, in_budget: list[int]) -> dict[str, Any]:
    """One server's comparable figures (the same measurement for stock and kvplugin)."""
    turns = run.get("turns") or []
    mem = run.get("memory") or {}
    return {
        "label": run.get("label"),
        "held_after_bytes": mem.get("held_after_bytes"),
        "conversations_in_budget": int(statistics.median(in_budget)) if in_budget else None,
        "conversations_in_budget_spread": [min(in_budget), max(in_budget)] if in_budget else None,
        "reuse_peak_over_bytes": mem.get("reuse_peak_over_bytes"),
        "reuse_peak_bytes": mem.get("reuse_peak_bytes"),
        "hwm_growth_bytes": mem.get("hwm_growth_bytes"),
        "ttft_cold_s": turns[0]["ttft_s"] if turns else None,
        "ttft_warm_s": _median([t["ttft_s"] for t in turns[1:]]),
        "tokens_reused": sum(t.get("cached_tokens") or 0 for t in turns),
    }


def format_report(result: Mapping[str, Any]) -> str:
    """The text ``kvplugin demo`` prints: what kvplugin did, stock beside it."""
    s = result["summary"]
    stats = result["stats"]
    q = stats.get("quantization")
    out = [
        f"kvplugin demo: {result['host']} {result['host_version']}, "
        + ("SmolLM2-135M-Instruct (real weights, fp32, OpenBLAS preloaded for both servers)"
           if result.get("model") == "smollm2" else
           "tiny local model (random weights: the answers are gibberish; the cache is real)"),
        f"  server: {result['command']}",
        "",
        f"conversation ({s['system_prompt_tokens']} prompt tokens in turn 1, "
        f"{len(result['turns'])} turns, streamed):",
    ]
    for t in result["turns"]:
        text = " ".join((t["text"] or "").split())
        text = text[:38] + ("..." if len(text) > 38 else "")
        out.append(f"  turn {t['turn']}: prompt {t['prompt_tokens'] or '?':>5} tokens, "
                   f"cached {t['cached_tokens'] if t['cached_tokens'] is not None else '?':>5}, "
                   f"first token after {_ms(t['ttft_s']):>7}   {text!r}")
    quant = (f"{q['bits']}-bit, group {q['group_size']}, entries from {q['min_tokens']} tokens, "
             f"policy {q.get('policy', 'always')}" if q else "off")
    ratio_held = (s["held_bytes_stored"] / s["held_bytes_fp16"]
                  if s["held_bytes_fp16"] and s["held_bytes_stored"] is not None else None)
    ratio_all = (s["stored_bytes"] / s["host_bytes"] if s["host_bytes"] else None)
    out += [
        "",
        f"what kvplugin did (GET {STATS_PATH}):",
        f"  entries stored       {s['entries_stored']}  ({s['entries_quantized']} quantized; "
        f"quantization {quant})",
        f"  cache hits           {s['hits']}  (misses {s['misses']}; "
        f"{s['tokens_reused']} prompt tokens reused)",
    ]
    if s["policy"] == "pressure":
        out.append(f"  under pressure       {s['demotions']} entries demoted (quantized in place "
                   f"when the budget needed room); hits at full precision {s['hits_full']}, on "
                   f"demoted entries {s['hits_demoted']}")
    if s["held_bytes_fp16"] is not None:
        out.append(
            f"  held now             {s['entries_held']} entries, {s['held_tokens']} tokens: "
            f"{_fmt_bytes(s['held_bytes_fp16'])} at full precision -> {_fmt_bytes(s['held_bytes_stored'])} "
            f"as stored" + (f" ({ratio_held:.3f}x)" if ratio_held is not None else ""))
    else:
        out.append(f"  held now             {s['entries_held']} entries, "
                   f"{_fmt_bytes(s['held_bytes_stored'])} as stored")
    out.append(
        f"  all entries stored   {_fmt_bytes(s['host_bytes'])} handed over by the host (full-precision "
        f"live caches) -> {_fmt_bytes(s['stored_bytes'])} stored (trimmed"
        f"{', quantized' if q else ''}; "
        + (f"{ratio_all:.3f}x)" if ratio_all is not None else "-)"))

    def row(name: str, cold, warm, sp, how: str) -> str:
        spd = f"{sp:5.1f}x faster" if sp else "     -"
        return f"  {name:<16} cold {_ms(cold):>8}   warm {_ms(warm):>8}   {spd}   ({how})"

    sbs = s.get("side_by_side") or {}
    if "stock" in sbs and "kvplugin" in sbs:
        st_, kv_ = sbs["stock"], sbs["kvplugin"]

        def pair(name: str, key: str, fmt: Callable[[Any], str], how: str) -> str:
            return f"  {name:<30} {fmt(st_[key]):>14} {fmt(kv_[key]):>16}   ({how})"

        def n(x: Any) -> str:
            return "-" if x is None else str(x)

        def pair_spread(name: str, key: str, how: str) -> str:
            cells = []
            for side, row_ in (("stock", st_), ("kvplugin", kv_)):
                lo_hi = row_.get(key + "_spread")
                cells.append(n(row_[key]) + (f" ({lo_hi[0]}-{lo_hi[1]})" if lo_hi else ""))
            return f"  {name:<30} {cells[0]:>14} {cells[1]:>16}   ({how})"

        out += [
            "",
            "stock vs kvplugin, the same conversation on each (every figure measured in this run):",
            f"  {'':<30} {'stock':>14} {'with kvplugin':>16}",
            pair("held after the conversation", "held_after_bytes", _fmt_bytes,
                 "MLX active memory, end minus before turn 1, recorded in the server process"),
            pair_spread("conversations in the budget", "conversations_in_budget",
                        f"the {_fmt_bytes(result.get('budget_bytes'))} budget / what the store "
                        f"held per conversation (GET {STATS_PATH}); median (min-max) of "
                        f"{len(result.get('held') or ())} repeats; stock: the same entries at "
                        f"full precision"),
            pair("peak above held, on reuse", "reuse_peak_over_bytes", _fmt_bytes,
                 "MLX peak during turns 2.. minus active before turn 2, same recorder"),
            pair("peak on reuse", "reuse_peak_bytes", _fmt_bytes,
                 "MLX peak during turns 2.. minus active before turn 1"),
            pair("process high-water growth", "hwm_growth_bytes", _fmt_bytes,
                 "VmHWM, end minus before turn 1"),
            pair("first token, turn 1 (cold)", "ttft_cold_s", _ms, "streamed"),
            pair("first token, later turns", "ttft_warm_s", _ms,
                 "median; the host's own prompt cache speeds stock up too: compare the columns"),
            pair("prompt tokens reused", "tokens_reused", n, "the servers' usage.cached_tokens"),
        ]
    out += [
        "",
        "time to first token with kvplugin (cold: the prompt's prefix is not cached; warm: the "
        "conversation so far is; the speed-up is the prompt cache's, which stock has too):",
        row("streaming", s["ttft_stream_cold_s"], s["ttft_stream_warm_s"], s["ttft_stream_speedup"],
            "first streamed token; turn 1 vs median of later turns"),
        row("1-token request", s["ttft_1tok_cold_s"], s["ttft_1tok_warm_s"], s["ttft_1tok_speedup"],
            "whole request, max_tokens=1; new system prompt vs its next turn"),
        "",
        "the server was stopped.",
    ]
    return "\n".join(out)
