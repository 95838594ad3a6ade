"""The server benchmark's results: ratios, goals, terminal tables and plots."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

from kvplugin.tools.bench import plots
from kvplugin.tools.bench.report import Goal, fmt_bytes, fmt_ratio, format_table
from kvplugin.tools.bench.server_phases import MiB, fmt_ms, fmt_x, safe_ratio

#: The server-level goals (limit values).
GOALS = {
    "warm_ttft_speedup": 10.0,  # cold / warm time to first token at the largest prefix (2k)
    "decode_throughput_ratio": 0.98,  # kvplugin / stock tokens per second
    "ratio_8bit": 0.532,  # stored / fp16 bytes of the server's entries
    "ratio_4bit": 0.282,
}


# =============================================================================================
# results


def ratios(res: Mapping[str, Any]) -> dict[str, Any]:
    st, kv = res["stock"], res["kvplugin"]
    out: dict[str, Any] = {}
    for size, k in kv["ttft"].items():
        s = st["ttft"][size]
        out[f"ttft_{size}"] = {
            "kvplugin_speedup_stream": k["stream_speedup"],
            "stock_speedup_stream": s["stream_speedup"],
            "kvplugin_speedup_one_token": k["one_token_speedup"],
            "stock_speedup_one_token": s["one_token_speedup"],
            "warm_kvplugin_over_stock_stream": safe_ratio(k["stream_warm_s"], s["stream_warm_s"]),
            "cold_kvplugin_over_stock_stream": safe_ratio(k["stream_cold_s"], s["stream_cold_s"]),
        }
    sm, km = st["memory"], kv["memory"]
    out["memory"] = {
        "rss_reuse_growth_kvplugin_over_stock": safe_ratio(km["rss_reuse_growth"],
                                                       sm["rss_reuse_growth"]),
        "rss_growth_kvplugin_over_stock": safe_ratio(km["rss_growth"], sm["rss_growth"]),
        "rss_peak_growth_kvplugin_over_stock": safe_ratio(km["rss_peak_growth"],
                                                      sm["rss_peak_growth"]),
        "rss_end_kvplugin_over_stock": safe_ratio(km["rss_end"], sm["rss_end"]),
    }
    sf, kf = st["fit"], kv["fit"]
    out["fit"] = {
        "conversations_held_kvplugin_over_stock": safe_ratio(kf["conversations_held"],
                                                         sf["conversations_held"]),
        "bytes_per_conversation_kvplugin_over_stock": safe_ratio(kf["bytes_per_conversation"],
                                                             sf["bytes_per_conversation"]),
        "entry_stored_over_fp16": safe_ratio(kf.get("entry_bytes_mean"),
                                         kf.get("entry_dense_bytes_mean")),
    }
    kd, sd = kv["decode"], st["decode"]
    paired = res.get("decode_paired") or {}
    out["decode"] = {
        "paired_cpu_median": (paired.get("cpu") or {}).get("median"),
        "paired_end_to_end_median": (paired.get("end_to_end") or {}).get("median"),
        "paired_first_last_median": (paired.get("first_last") or {}).get("median"),
        "tokens_per_cpu_s_kvplugin_over_stock": safe_ratio(kd.get("tokens_per_cpu_s"),
                                                       sd.get("tokens_per_cpu_s")),
        "median_decode_tps_kvplugin_over_stock": safe_ratio(kd["decode_tps"], sd["decode_tps"]),
        "best_decode_tps_kvplugin_over_stock": safe_ratio(kd["decode_tps_best"], sd["decode_tps_best"]),
        "median_e2e_tps_kvplugin_over_stock": safe_ratio(kd["e2e_tps"], sd["e2e_tps"]),
    }
    return out


def goals(res: Mapping[str, Any]) -> list[Goal]:
    cfg = res["config"]
    size = str(max(cfg["sizes"]))
    r = res["ratios"]
    k = res["kvplugin"]["ttft"][size]
    st = res["stock"]["ttft"][size]
    note = (f"kvplugin server, {size}-token prefix, streamed first token, median of "
            f"{cfg['repeats']}: cold {fmt_ms(k['stream_cold_s'])}, warm {fmt_ms(k['stream_warm_s'])} "
            f"(stock: {fmt_x(st['stream_speedup'])}; 1-token requests: kvplugin "
            f"{fmt_x(k['one_token_speedup'])}, stock {fmt_x(st['one_token_speedup'])})")
    if size != "2048":
        note += f"; the goal is stated for 2048 tokens, this run used {size}"
    out = [Goal(f"warm TTFT speed-up at {size} tokens", k["stream_speedup"],
                GOALS["warm_ttft_speedup"], ">=", "x", note)]
    rd = r["decode"]
    paired = res.get("decode_paired") or {}

    def iqr(key: str) -> str:
        q = paired.get(key) or {}
        if q.get("median") is None:
            return "-"
        return f"{q['median']:.3f}x (quartiles {q['q1']:.3f}-{q['q3']:.3f})"

    others = (f"per-round end to end {iqr('end_to_end')}, first-to-last token "
              f"{iqr('first_last')}; overall tokens per CPU-second "
              f"{fmt_x(rd['tokens_per_cpu_s_kvplugin_over_stock'], 3)}, median first-to-last rate "
              f"{fmt_x(rd['median_decode_tps_kvplugin_over_stock'], 3)}")
    how = (f"{cfg['decode_rounds']} rounds, each one streamed request of {cfg['decode_tokens']} "
           f"tokens to both servers back to back; the value is the median over rounds of")
    if rd["paired_cpu_median"] is not None:
        dec = rd["paired_cpu_median"]
        dnote = (f"{how} stock CPU-seconds / kvplugin CPU-seconds of the server process "
                 f"{iqr('cpu')} (its own CPU time: the least disturbed by other processes on a "
                 f"shared machine); {others}")
    else:  # no /proc: wall clock
        dec = rd["paired_end_to_end_median"]
        dnote = f"{how} stock time / kvplugin time; {others}"
    out.append(Goal("decode throughput kvplugin / stock", dec, GOALS["decode_throughput_ratio"],
                    ">=", "x", dnote))
    bits = cfg["kv_bits"]
    stored = r["fit"]["entry_stored_over_fp16"]
    if bits in (8, 4) and stored is not None:
        key = "ratio_8bit" if bits == 8 else "ratio_4bit"
        out.append(Goal(f"{bits}-bit stored / fp16 bytes (server entries)", stored, GOALS[key],
                        "<=", "x", "GET /kvplugin/stats entries of the budget phase: nbytes / "
                        "dense_nbytes (trimmed fp16), group size 64"))
    return out


def _fmt_tps(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def tables(res: Mapping[str, Any]) -> str:
    st, kv, r = res["stock"], res["kvplugin"], res["ratios"]
    cfg = res["config"]
    parts = []
    rows = []
    for size in kv["ttft"]:
        s, k = st["ttft"][size], kv["ttft"][size]
        for how, label in (("stream", "streamed"), ("one_token", "1-token")):
            rows.append([f"{size} tok, {label}",
                         fmt_ms(s[f"{how}_cold_s"]), fmt_ms(s[f"{how}_warm_s"]), fmt_x(s[f"{how}_speedup"]),
                         fmt_ms(k[f"{how}_cold_s"]), fmt_ms(k[f"{how}_warm_s"]), fmt_x(k[f"{how}_speedup"]),
                         "-" if k[f"{how}_warm_cached_tokens"] is None
                         else f"{k[f'{how}_warm_cached_tokens']:.0f}"])
    parts.append(format_table(
        ["prefix", "stock cold", "stock warm", "speed-up", "kvp cold", "kvp warm", "speed-up",
         "kvp cached"], rows,
        f"time to first token (median of {cfg['repeats']}; cold = new prefix, warm = next turn; "
        "streamed = first token, 1-token = whole request)"))
    sm, km = st["memory"], kv["memory"]
    rows = []
    for name, m in (("stock", sm), ("kvplugin", km)):
        rows.append([name, fmt_bytes(m["rss_start"]), fmt_bytes(m["rss_after_cold"]),
                     fmt_bytes(m["rss_end"]), fmt_bytes(m["rss_growth"]),
                     fmt_bytes(m["rss_reuse_growth"]), fmt_bytes(m["rss_peak_growth"]),
                     fmt_bytes(m.get("store_growth")) if name == "kvplugin" else "(no stats)"])
    rm = r["memory"]
    rows.append(["kvplugin / stock", "", "", fmt_ratio(rm["rss_end_kvplugin_over_stock"]),
                 fmt_ratio(rm["rss_growth_kvplugin_over_stock"]),
                 fmt_ratio(rm["rss_reuse_growth_kvplugin_over_stock"]),
                 fmt_ratio(rm["rss_peak_growth_kvplugin_over_stock"]), ""])
    parts.append(format_table(
        ["server", "RSS start", "after turn 1", "RSS end", "growth", "growth in reuse",
         "peak growth", "stored growth"],
        rows, f"memory across reuse ({sm['conversations']} conversations x {sm['turns']} turns, "
              f"{sm['prefix_tokens']}-token prefixes; server process RSS; turn 1 = the cold "
              f"prefills, then every turn reuses)"))
    sf, kf = st["fit"], kv["fit"]
    rows = []
    for name, f in (("stock", sf), ("kvplugin", kf)):
        held = f"{f['conversations_held']}" + ("+" if f["saturated"] else "")
        rows.append([name, held, fmt_bytes(f["bytes_per_conversation"]),
                     fmt_bytes(f.get("entry_bytes_mean")) if name == "kvplugin" else "(no stats)",
                     fmt_bytes(f.get("entry_dense_bytes_mean")) if name == "kvplugin" else ""])
    rows.append(["kvplugin / stock",
                 fmt_ratio(r["fit"]["conversations_held_kvplugin_over_stock"], 2),
                 fmt_ratio(r["fit"]["bytes_per_conversation_kvplugin_over_stock"]), "", ""])
    parts.append(format_table(
        ["server", "held", "budget / held", "entry stored", "entry fp16"], rows,
        f"conversations held in a {fmt_bytes(sf['budget_bytes'])} prompt-cache budget "
        f"({sf['prefix_tokens']}-token prefixes; + = every one tried fit)"))
    sd, kd = st["decode"], kv["decode"]
    rd = r["decode"]

    def row(name: str, d: Mapping[str, Any]) -> list[str]:
        return [name, _fmt_tps(d.get("tokens_per_cpu_s")), _fmt_tps(d["decode_tps"]),
                _fmt_tps(d["decode_tps_best"]), _fmt_tps(d["e2e_tps"])]

    rows = [row("stock", sd), row("kvplugin", kd),
            ["kvplugin / stock", fmt_ratio(rd["tokens_per_cpu_s_kvplugin_over_stock"]),
             fmt_ratio(rd["median_decode_tps_kvplugin_over_stock"]),
             fmt_ratio(rd["best_decode_tps_kvplugin_over_stock"]),
             fmt_ratio(rd["median_e2e_tps_kvplugin_over_stock"])],
            ["  paired by round", fmt_ratio(rd["paired_cpu_median"]),
             fmt_ratio(rd["paired_first_last_median"]), "",
             fmt_ratio(rd["paired_end_to_end_median"])]]
    parts.append(format_table(
        ["server", "per CPU-s", "first-last median", "first-last best", "end-to-end median"],
        rows,
        f"decode throughput, tokens/s ({cfg['decode_rounds']} rounds of one streamed "
        f"{cfg['decode_tokens']}-token request per server; per CPU-s = per second of the "
        f"server's own CPU time; first-last = wall clock from the first to the last token; "
        f"paired = median over rounds of the ratio within the round)"))
    return "\n\n".join(parts)


# =============================================================================================
# plots


def plot_memory(res: Mapping[str, Any], path: Path) -> Path | None:
    """RSS over time during the reuse phase (left) and per-request peaks (right)."""
    plt = plots._pyplot()
    if plt is None:
        return None
    colours = {"stock": "#d62728", "kvplugin": "#1f77b4"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for kind in ("stock", "kvplugin"):
        m = res[kind]["memory"]
        base = m["rss_start"] or 0
        xs = [t for t, _ in m["series"]]
        ys = [(r - base) / MiB for _, r in m["series"]]
        a1.plot(xs, ys, color=colours[kind], lw=1.0, label=f"{kind}: server RSS")
        if m.get("t_after_cold") is not None:
            a1.axvline(m["t_after_cold"], color=colours[kind], ls=":", lw=0.8)
        reqs = m["requests"]
        a2.plot(range(1, len(reqs) + 1),
                [((q["rss_peak"] or base) - base) / MiB for q in reqs], "o-", ms=3,
                color=colours[kind], lw=1.0, label=f"{kind}: RSS peak during request")
        if kind == "kvplugin" and any(q.get("store_bytes") is not None for q in reqs):
            b0 = m.get("store_bytes_start") or 0
            a2.plot(range(1, len(reqs) + 1), [((q.get("store_bytes") or b0) - b0) / MiB
                                              for q in reqs],
                    "s--", ms=3, color="#17becf", lw=1.0,
                    label="kvplugin: bytes stored (GET /kvplugin/stats)")
    a2.axvline(res["stock"]["memory"]["conversations"] + 0.5, color="grey", ls=":", lw=0.8)
    m = res["stock"]["memory"]
    a1.set_title(f"{m['conversations']} conversations x {m['turns']} turns, "
                 f"{m['prefix_tokens']}-token prefixes", fontsize=10)
    a1.set_xlabel("seconds since the first request (dotted: end of the cold first turns)")
    a1.set_ylabel("MiB above RSS at the start of the phase")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a2.set_xlabel("request (round robin over the conversations)")
    a2.set_ylabel("MiB above the start of the phase")
    a2.set_title("per request (left of the dotted line: cold first turns)", fontsize=10)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    cfg = res["config"]
    fig.suptitle(f"memory across reuse: stock vs kvplugin ({cfg['host']} {cfg['host_version']}, "
                 f"tiny model, CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft(res: Mapping[str, Any], path: Path) -> Path | None:
    """Cold vs warm time to first token per prefix size, stock and kvplugin (log scale)."""
    plt = plots._pyplot()
    if plt is None:
        return None
    sizes = list(res["kvplugin"]["ttft"])
    bars = [("stock", "cold", "#ff9896"), ("stock", "warm", "#d62728"),
            ("kvplugin", "cold", "#aec7e8"), ("kvplugin", "warm", "#1f77b4")]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.8 / len(bars)
    for i, (kind, temp, colour) in enumerate(bars):
        ys = [(res[kind]["ttft"][s][f"stream_{temp}_s"] or 0) * 1000 for s in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], ys, width, color=colour,
               label=f"{kind} {temp}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{s}-token prefix" for s in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("time to first streamed token, ms (log)")
    ax.set_title("cold (new prefix) vs warm (next turn) time to first token")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(res: Mapping[str, Any], out: Path) -> dict[str, str]:
    from kvplugin.tools.bench.plots import MISSING_MESSAGE

    made = {}
    for name, fn in (("memory", plot_memory), ("ttft", plot_ttft)):
        p = fn(res, out / f"server_{name}.png")
        if p is None:
            print(MISSING_MESSAGE, file=sys.stderr)
            return {}
        made[name] = str(p)
    return made
