"""PNG plots of the benchmark results (matplotlib, imported lazily, Agg backend).

Every function takes plain data (lists of numbers), writes one PNG and returns its path, or
returns ``None`` when matplotlib is not installed (:func:`available` tells, and
:data:`MISSING_MESSAGE` says what to do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "MISSING_MESSAGE",
    "available",
    "plot_memory_growth",
    "plot_reuse",
    "plot_step_latency",
    "plot_quality",
]

MISSING_MESSAGE = (
    "matplotlib is not installed: PNG plots were skipped (the JSON holds the same data). "
    "Install it with `pip install matplotlib` to get the plots."
)

# Stock runs in warm colours, kvplugin in cool ones, so that a glance tells them apart.
_STOCK = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"]
_KVP = ["#1f77b4", "#2ca02c", "#17becf", "#9467bd"]


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def available() -> bool:
    return _pyplot() is not None


def _colours(names: Sequence[str], kinds: Mapping[str, str]) -> dict[str, str]:
    out, s, k = {}, 0, 0
    for n in names:
        if kinds.get(n) == "stock":
            out[n] = _STOCK[s % len(_STOCK)]
            s += 1
        else:
            out[n] = _KVP[k % len(_KVP)]
            k += 1
    return out


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory_growth(runs: Mapping[str, Mapping[str, Any]], path: Path,
                       title: str) -> Path | None:
    """Memory while filling a cache: per-step peak (solid) and active memory after the step.

    ``runs[name]`` holds ``label``, ``kind`` ("stock"/"kvplugin"), ``step``, ``peak_mib``,
    ``active_mib`` (same lengths).
    """
    plt = _pyplot()
    if plt is None:
        return None
    names = list(runs)
    col = _colours(names, {n: runs[n]["kind"] for n in names})
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for i, n in enumerate(names):
        r = runs[n]
        ls = "-" if r["kind"] == "stock" else "--"
        lw = max(3.2 - 0.45 * i, 1.0)  # earlier lines wider, so overlapping ones stay visible
        ax.plot(r["step"], r["peak_mib"], ls, color=col[n], lw=lw, label=f"{r['label']} (peak)")
        ax.plot(r["step"], r["active_mib"], ":", color=col[n], lw=0.9, alpha=0.7)
    ax.set_xlabel("tokens in cache (prefill, then one decode step per token)")
    ax.set_ylabel("MiB (solid/dashed: peak during step, dotted: held after step)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, plt, path)


def plot_reuse(panels: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path,
               title: str) -> Path | None:
    """Memory across the reuse of a stored entry (stored, fetch, first update, decode steps).

    ``panels[panel title][name]`` holds ``label``, ``kind``, ``events`` (x tick labels),
    ``peak_mib`` and ``active_mib``; one subplot per panel.
    """
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (ptitle, runs) in zip(axes[0], panels.items()):
        names = list(runs)
        col = _colours(names, {n: runs[n]["kind"] for n in names})
        for n in names:
            r = runs[n]
            x = list(range(len(r["events"])))
            ls = "-" if r["kind"] == "stock" else "--"
            ax.step(x, r["peak_mib"], ls, where="mid", color=col[n], lw=1.4,
                    label=f"{r['label']} (peak)")
            ax.step(x, r["active_mib"], ":", where="mid", color=col[n], lw=1.0, alpha=0.8)
        events = runs[names[0]]["events"]
        ax.set_xticks(list(range(len(events))))
        ax.set_xticklabels([e if (i < 4 or i == len(events) - 1) else "" for i, e in
                            enumerate(events)], rotation=30, ha="right", fontsize=7)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("MiB above baseline (peak in step; dotted: held after)")
        ax.set_title(ptitle, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    return _save(fig, plt, path)


def plot_step_latency(runs: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> Path | None:
    """Decode-step latency: over time (left, log scale) and its distribution (right, CCDF).

    ``runs[name]`` holds ``label``, ``kind``, ``latency_ms`` (one value per decode step).
    """
    plt = _pyplot()
    if plt is None:
        return None
    names = list(runs)
    col = _colours(names, {n: runs[n]["kind"] for n in names})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for n in names:
        r = runs[n]
        lat = list(r["latency_ms"])
        if not lat:
            continue
        a1.plot(range(len(lat)), lat, lw=0.6, color=col[n], alpha=0.8, label=r["label"])
        s = sorted(lat)
        m = len(s)
        a2.step(s, [1 - i / m for i in range(m)], where="post", color=col[n], lw=1.2,
                label=r["label"])
    a1.set_yscale("log")
    a1.set_xlabel("decode step")
    a1.set_ylabel("ms (log)")
    a1.grid(alpha=0.3)
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("step latency, ms (log)")
    a2.set_ylabel("fraction of steps slower (log)")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, plt, path)


def plot_quality(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path | None:
    """KL divergence (left, log) and greedy agreement (right) per bit width, one line per group.

    ``rows`` hold ``bits``, ``group_size``, ``kl_mean`` and ``greedy_agreement`` (0..1).
    """
    plt = _pyplot()
    if plt is None:
        return None
    groups = sorted({r["group_size"] for r in rows})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, g in enumerate(groups):
        rs = sorted((r for r in rows if r["group_size"] == g and r.get("kl_mean") is not None),
                    key=lambda r: r["bits"])
        if not rs:
            continue
        bits = [r["bits"] for r in rs]
        a1.plot(bits, [max(r["kl_mean"], 1e-12) for r in rs], "o-", color=_KVP[i % 4],
                label=f"group {g}")
        a2.plot(bits, [100 * r["greedy_agreement"] for r in rs], "o-", color=_KVP[i % 4],
                label=f"group {g}")
    a1.axhline(1e-3, color="#d62728", ls="--", lw=1, label="goal at 8 bits: KL <= 1e-3")
    a1.set_yscale("log")
    a1.set_xlabel("bits")
    a1.set_ylabel("mean KL(fp16 || quantized), nats")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a2.axhline(99, color="#d62728", ls="--", lw=1, label="goal at 8 bits: >= 99%")
    a2.set_xlabel("bits")
    a2.set_ylabel("greedy agreement, %")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, plt, path)
