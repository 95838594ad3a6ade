"""Precision as a tier: ``kvplugin bench --pressure``.

Real host processes, stock beside kvplugin's two quantization policies, ``always`` and
``pressure``, at the same bits: ``mlx_lm.server`` (``--host mlx-lm``, the default) on its
sequential path (seeded requests: the budget is then the store's alone) or ``--path batched``
(mlx-lm also trims the store by the batch's live caches on every admission), or ``vllm-mlx
serve`` (``--host vllm-mlx``) in its ``simple`` mode or ``--path continuous-batching``; the
budget is the host's own flag (``--prompt-cache-bytes``; ``--cache-memory-mb``, whole MiB):

* **room to spare**: one conversation behind a long system prompt, a budget far above it: the
  warm time to first token of its later turns (median), where ``always`` pays a quantize and a
  restore per turn and ``pressure`` a move;
* **under pressure**: a budget of ``N`` fp16 entries and ``3N`` conversations taking turns
  (every first turn, then every second turn in the same order): the conversations kept (second
  turns that reused their first turn's prompt: the host's ``cached_tokens``, or kvplugin's
  store where the host reports none, so vllm-mlx's stock reads "-"), the process's VmHWM and
  MLX peak, the
  demotions on the store's worker, the entries quantized as they were stored because the budget
  could not hold them at full precision (``demotions_at_insert``: the codec on the inserting
  thread, as ``always`` runs it for every entry) and the entries evicted at full precision
  because the worker had not reached them (``evictions_full``).
  The pressure server's resident memory is sampled over the run (``pressure-memory.json``, and
  a PNG with ``kvplugin[bench]``).

Every time is the client's clock on a streamed request. The model is the real
SmolLM2-135M-Instruct (float32, OpenBLAS preloaded on Linux for every server), or the KV-heavy
llama (``--model kv-heavy``), or the tiny one (``--tiny``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvplugin.hostspecs import declaration
from kvplugin.tools import hostcmd, hostproc
from kvplugin.tools.bench.remote import _prefix
from kvplugin.tools.client import stream_chat

POLICIES = ("stock", "always", "pressure")
#: each host's serving paths (the first is its default) and the flags that select them
PATHS = {"mlx-lm": {"sequential": (), "batched": ()},
         "vllm-mlx": {"simple": (), "continuous-batching": ("--continuous-batching",)}}
QUESTIONS = ("What is this about?", "Say more.", "And then?", "Anything else?")


def _status(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` size field in bytes (0 where there is none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """The resident memory of one process every ``interval`` seconds, on a thread."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.rows: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, interval), daemon=True)
        self._t0 = time.monotonic()
        self._thread.start()

    def _run(self, pid: int, interval: float) -> None:
        while not self._stop.wait(interval):
            self.rows.append((time.monotonic() - self._t0, _status(pid, "VmRSS")))

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        return self.rows


def _settled(srv: Any, timeout: float = 30.0) -> dict:
    """The stats once the store stopped moving (mlx-lm stores after answering; the pressure
    worker demotes after that)."""
    last, deadline = None, time.monotonic() + timeout
    while True:
        now = srv.get("/kvplugin/stats")
        keys = ("store_stored", "store_bytes", "demotions")
        if last is not None and all(now[k] == last[k] for k in keys) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.1)


def _conversation(system: str) -> list[dict]:
    return [{"role": "system", "content": system}]


def room_to_spare(start: Callable[..., Any], system: str, turns: int, seed: int | None) -> dict:
    """One conversation, a budget far above it: warm TTFT of its later turns per policy."""
    out = {}
    for policy in POLICIES:
        srv = start(policy, 1 << 40)
        stream_chat(srv, [{"role": "user", "content": "Hello."}], max_tokens=1, seed=seed)
        history, ttfts = _conversation(system), []
        for t in range(turns):
            history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            reply = stream_chat(srv, history, max_tokens=8, seed=seed)
            history.append({"role": "assistant", "content": reply.text})
            ttfts.append(reply.ttft_s)
            if policy != "stock":
                _settled(srv)
        stats = srv.get("/kvplugin/stats") if policy != "stock" else {}
        out[policy] = {"cold_ttft_s": ttfts[0], "warm_ttft_s": statistics.median(ttfts[1:]),
                       "warm_ttfts_s": ttfts[1:], "hits_full": stats.get("hits_full"),
                       "hits_demoted": stats.get("hits_demoted"),
                       "entries_quantized": stats.get("entries_quantized")}
        if policy == "pressure":
            entry = max(stats["entries"], key=lambda e: e["tokens"])
            out["fp16_bytes_per_token"] = entry["dense_nbytes"] / entry["tokens"]
        srv.stop()
    return out


def under_pressure(start: Callable[..., Any], systems: list[str], budget: int,
                   kept_from: int, seed: int | None) -> dict:
    """``len(systems)`` conversations taking turns on a ``budget``: what each policy keeps."""
    out = {}
    for policy in POLICIES:
        srv = start(policy, budget)
        sampler = Sampler(srv.pid) if policy == "pressure" else None
        answers, kept, reused = [], 0, []
        kv = policy != "stock"
        for system in systems:
            reply = stream_chat(srv, [*_conversation(system),
                                      {"role": "user", "content": QUESTIONS[0]}], max_tokens=8,
                                seed=seed)
            answers.append(reply.text)
            if policy != "stock":
                _settled(srv)
        before = srv.get("/kvplugin/stats") if kv else {}
        for system, answer in zip(systems, answers):
            history = [*_conversation(system), {"role": "user", "content": QUESTIONS[0]},
                       {"role": "assistant", "content": answer},
                       {"role": "user", "content": QUESTIONS[1]}]
            reply = stream_chat(srv, history, max_tokens=8, seed=seed)
            got = reply.cached_tokens
            if kv:
                after = _settled(srv)
                if got is None:  # the host does not say: the store's count
                    got = after["store_tokens_reused"] - before["store_tokens_reused"]
                before = after
            reused.append(got)
            kept += (got or 0) >= kept_from
        stats = srv.get("/kvplugin/stats") if kv else {}
        out[policy] = {
            "conversations": len(systems),
            "kept": None if None in reused else kept, "reused_tokens": reused,
            "vmhwm_bytes": _status(srv.pid, "VmHWM"),
            "mlx_peak_bytes": stats.get("mlx_peak_memory"),
            "demotions": stats.get("demotions"), "evictions_full": stats.get("evictions_full"),
            "demotions_at_insert": stats.get("demotions_at_insert"),
            "evictions": stats.get("store_evictions"), "store_bytes": stats.get("store_bytes"),
        }
        if sampler is not None:
            out["pressure_memory"] = sampler.stop()
        srv.stop()
    return out


def table(res: dict) -> str:
    room, tight = res["room_to_spare"], res["under_pressure"]
    ms = lambda s: "-" if s is None else f"{1000 * s:.0f} ms"  # noqa: E731
    mib = lambda b: "-" if not b else f"{b / 2**20:.1f} MiB"  # noqa: E731
    out = [f"{'policy':<9} {'warm TTFT':>10} {'vs stock':>8} {'kept':>7} {'VmHWM':>10} "
           f"{'MLX peak':>10} {'demotions':>9} {'at insert':>9} {'evicted at full precision':>25}"]
    for p in POLICIES:
        r, t = room[p], tight[p]
        out.append(
            f"{p:<9} {ms(r['warm_ttft_s']):>10} {r['warm_ttft_s'] / room['stock']['warm_ttft_s']:>7.2f}x "
            f"{'-' if t['kept'] is None else t['kept']:>3}/{t['conversations']:<3} "
            f"{mib(t['vmhwm_bytes']):>10} "
            f"{mib(t['mlx_peak_bytes']):>10} {t['demotions'] if t['demotions'] is not None else '-':>9} "
            f"{'-' if t.get('demotions_at_insert') is None else t['demotions_at_insert']:>9} "
            f"{t['evictions_full'] if t['evictions_full'] is not None else '-':>25}")
    return "\n".join(out)


def _plot(rows: list, path: Path, marks: dict[str, int]) -> bool:
    """VmRSS over the pressure run, each of ``marks`` (a label: bytes) a horizontal line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([t for t, _ in rows], [b / 2**20 for _, b in rows], label="pressure VmRSS")
    for (label, value), style in zip(marks.items(), ("--", ":", "-.")):
        if value:
            ax.axhline(value / 2**20, linestyle=style, color="gray", label=label)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("seconds"), ax.set_ylabel("VmRSS (MiB)")
    ax.set_title("pressure policy: the server's resident memory over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvplugin bench --pressure",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--pressure", action="store_true", help="(selects this bench)")
    p.add_argument("--tiny", action="store_true", help="the tiny offline model (seconds)")
    p.add_argument("--model", choices=("smollm2", "kv-heavy"), default="smollm2",
                   help="the real model (default smollm2; kv-heavy: the KV-heavy llama)")
    p.add_argument("--bits", type=int, default=4, help="quantization bits (default 4)")
    p.add_argument("--prefix-tokens", type=int, default=512,
                   help="system prompt of every conversation, in tokens (default 512)")
    p.add_argument("--fp16-entries", type=int, default=3, metavar="N",
                   help="the budget under pressure holds N fp16 entries (default 3)")
    p.add_argument("--conversations", type=int, default=None,
                   help="conversations taking turns under pressure (default 3N)")
    p.add_argument("--host", choices=tuple(PATHS), default="mlx-lm", help="default: mlx-lm")
    p.add_argument("--path", choices=[q for paths in PATHS.values() for q in paths],
                   default=None, help="the host's serving path: mlx-lm sequential (seeded "
                   "requests; its default) or batched, vllm-mlx simple (its default) or "
                   "continuous-batching")
    p.add_argument("--out", type=Path, default=Path("bench-results/pressure"))
    args = p.parse_args(argv)
    args.path = args.path or next(iter(PATHS[args.host]))
    if args.path not in PATHS[args.host]:
        p.error(f"--path {args.path} is not a path of {args.host} "
                f"(one of: {', '.join(PATHS[args.host])})")
    decl = declaration(args.host)
    if not args.tiny:
        from kvplugin.tools import blas

        if (rc := blas.rerun_preloaded("kvplugin.tools.bench.pressure", argv)) is not None:
            return rc
    from tokenizers import Tokenizer

    from kvplugin.tools.models import realtext

    words = " ".join(realtext.paragraphs()).split()
    with tempfile.TemporaryDirectory(prefix="kvplugin-pressure-bench-") as tmp:
        if args.tiny:
            from kvplugin.tools.models.tiny import build_tiny_model

            model, name = build_tiny_model(Path(tmp) / "model"), "tiny random llama"
        elif args.model == "kv-heavy":
            from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

            model, name = build_kv_heavy_model(), "KV-heavy llama (float32)"
        else:
            from kvplugin.tools.models.smollm2 import build_smollm2

            model, name = build_smollm2(), "SmolLM2-135M-Instruct float32"
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731

        def start(policy: str, budget: int) -> Any:
            port = hostcmd.free_port()
            quant = [] if policy == "stock" else [
                "--kv-cache-quantization-bits", str(args.bits), "--hot-cache-only",
                "--kv-cache-quantization-policy", policy]
            fill = {"bytes": budget, "mb": budget >> 20}
            srv = hostproc.ServerProcess(
                hostcmd.host_cmd(decl, model, port, *(a.format(**fill) for a in decl.budget_args),
                                 *PATHS[args.host][args.path], *quant),
                port=port, env={**decl.launch_env,
                                **({"KVPLUGIN_DISABLE": "1"} if policy == "stock" else {})},
                model=hostcmd.SERVED_MODEL_NAME if decl.request_needs_model else None,
                workdir=Path(tmp) / f"{policy}-{budget}-{time.monotonic_ns()}",
                startup_timeout=300)
            return srv.start()

        seed = 0 if args.path == "sequential" else None
        room = room_to_spare(start, _prefix(words, args.prefix_tokens, 0, count), 4, seed)
        entry = room["fp16_bytes_per_token"] * (args.prefix_tokens + 40)  # + turn 1
        budget = int(args.fp16_entries * entry)
        if args.host == "vllm-mlx":
            budget = round(budget / 2**20) << 20  # --cache-memory-mb takes whole MiB
        systems = [_prefix(words, args.prefix_tokens, i + 1, count)
                   for i in range(args.conversations or 3 * args.fp16_entries)]
        tight = under_pressure(start, systems, budget, args.prefix_tokens // 2, seed)
    res = {"model": name, "host": f"{decl.label} {hostcmd.host_version(decl.distribution)}",
           "bits": args.bits,
           "path": args.path,
           "prefix_tokens": args.prefix_tokens, "budget_bytes": budget,
           "room_to_spare": room, "under_pressure": tight}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pressure.json").write_text(json.dumps(res, indent=1))
    plotted = _plot(tight.get("pressure_memory") or [], args.out / "pressure-memory.png",
                    {f"{p} VmHWM": tight[p]["vmhwm_bytes"] for p in POLICIES})
    text = (f"kvplugin bench --pressure: {res['host']} ({args.path} path), {name}, "
            f"{args.bits}-bit entries, {args.prefix_tokens}-token system prompts; warm TTFT: "
            f"median of turns 2-4 of one conversation, budget unlimited; under pressure: budget "
            f"{budget / 2**20:.1f} MiB = {args.fp16_entries} fp16 entries, "
            f"{len(systems)} conversations taking turns, kept = second turns reusing "
            f">= {args.prefix_tokens // 2} tokens\n\n" + table(res)
            + ("\n\nmemory over time: pressure-memory.png" if plotted else ""))
    (args.out / "pressure.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
