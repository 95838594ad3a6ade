"""Server-level benchmark: the stock host vs the kvplugin host, real processes, tiny model.

``kvplugin bench --server`` / ``python -m kvplugin.tools.bench.server``. Starts the host twice on
the tiny local model (:mod:`kvplugin.tools.models.tiny`) with the same command line: once with
``KVPLUGIN_DISABLE=1`` (stock) and once with kvplugin's settings given as ``KVPLUGIN_*``
variables (quantized entries, ``--kv-bits`` bits by default 8), and drives the same
workload through the OpenAI API of both:

1. **time to first token**, cold (a prefix the server has not seen) vs warm (the next turn
   of the same conversation), at each ``--sizes`` prefix length, measured two ways: the first
   streamed token, and a whole non-streamed request with ``max_tokens=1``;
2. **memory across reuse**: ``--conversations`` conversations with long system prompts,
   ``--turns`` turns each, round robin (every turn reuses the conversation's cached prefix);
   the server's resident memory (``VmRSS``/``VmHWM`` of its process, sampled every 20 ms
   from ``/proc``; ``ps`` elsewhere) and kvplugin's own stats bytes;
3. **conversations held** in a fixed prompt-cache budget (``--fit-budget``; a fresh server of
   each kind): the largest ``n`` such that, after ``n`` new conversations, the first one's
   next turn still hits the cache (binary search, fresh conversations for every probe);
   stored bytes per conversation follow (budget / held; kvplugin's entries also directly);
4. **decode throughput** with kvplugin on vs off: ``--decode-rounds`` rounds, each one new
   short prompt streamed with ``--decode-tokens`` tokens to both servers back to back (both
   running, one request at a time, ABBA order). The goal is judged on the median over rounds
   of the servers' own CPU time (stock / kvplugin, from ``/proc/<pid>/stat``), which other
   jobs on a shared machine disturb least; wall-clock rates are reported next to it.

Output: a terminal table of ratios with the issue's goals marked met/missed, ``server.json``
and PNG plots (matplotlib, if installed) in ``--out``. Timings on a shared CPU are noisy:
the JSON keeps every sample.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvplugin.tools import hostproc
from kvplugin.tools.bench import plots
from kvplugin.tools.bench.report import (
    Goal,
    Progress,
    environment,
    fmt_bytes,
    fmt_ratio,
    format_table,
    goals_table,
    save_results,
)
from kvplugin.tools.client import get_stats, stream_chat, timed_chat
from kvplugin.tools.console import Status, cleanup_signals, parse_size, stop_quietly
from kvplugin.tools.hostproc import HostNotInstalled, ServerProcess, ServerStartError
from kvplugin.tools.launch import HOSTS, DemoFailed, HostSpec, host_spec, prepare_model
from kvplugin.tools.prompts import QUESTIONS, TextMaker

__all__ = ["main", "build_parser", "run", "GOALS", "RssSampler"]

KiB = 1 << 10
MiB = 1 << 20

#: The issue's server-level goals (limit values).
GOALS = {
    "warm_ttft_speedup": 10.0,  # cold / warm time to first token at the largest prefix (2k)
    "decode_throughput_ratio": 0.98,  # kvplugin / stock tokens per second
    "ratio_8bit": 0.532,  # stored / fp16 bytes of the server's entries
    "ratio_4bit": 0.282,
}

DEFAULTS = dict(sizes=[1024, 2048], repeats=3, conversations=4, turns=6, mem_prefix=2048,
                mem_tokens=32, fit_budget=8 * MiB, fit_prefix=512, fit_max=32,
                decode_rounds=20, decode_tokens=128, decode_prompt=64)
QUICK = dict(sizes=[256, 512], repeats=1, conversations=2, turns=3, mem_prefix=512,
             mem_tokens=8, fit_budget=1 * MiB, fit_prefix=256, fit_max=12,
             decode_rounds=2, decode_tokens=64, decode_prompt=64)

SAMPLE_INTERVAL = 0.02


# =============================================================================================
# memory of a process, from outside


def _proc_status(pid: int) -> tuple[int | None, int | None]:
    """(VmRSS, VmHWM) in bytes from /proc (Linux)."""
    rss = hwm = None
    with open(f"/proc/{pid}/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith(b"VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


def read_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads) from /proc; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _ps_rss(pid: int) -> tuple[int | None, int | None]:
    """(RSS, None) via ``ps`` (macOS and other systems without /proc)."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                         timeout=5).stdout.strip()
    return (int(out) * 1024 if out else None), None


def read_memory(pid: int) -> tuple[int | None, int | None]:
    """Resident set size and its high-water mark (None where the system does not say)."""
    if os.path.exists(f"/proc/{pid}/status"):
        try:
            return _proc_status(pid)
        except (OSError, ValueError):
            return None, None
    try:
        return _ps_rss(pid)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None, None


class RssSampler:
    """Samples a server process's RSS every ``interval`` seconds in a thread.

    ``samples`` holds ``(t, rss_bytes)`` with ``t`` in seconds since the sampler started.
    """

    def __init__(self, pid: int, interval: float = SAMPLE_INTERVAL):
        self.pid = pid
        self.interval = interval if os.path.exists(f"/proc/{pid}") else max(interval, 0.25)
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"rss-{pid}")

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, _ = read_memory(self.pid)
            if rss is not None:
                self.samples.append((self.now(), rss))
            self._stop.wait(self.interval)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def window(self, t0: float, t1: float) -> list[tuple[float, int]]:
        return [(t, r) for t, r in list(self.samples) if t0 <= t <= t1]

    def current(self) -> int | None:
        rss, _ = read_memory(self.pid)
        return rss


# =============================================================================================
# small helpers


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _system(maker: TextMaker, n: int, seed: Any) -> str:
    return maker.text(n, seed, "Notes")


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _x(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


# =============================================================================================
# phases


def warm_up(srv: ServerProcess, maker: TextMaker, size: int) -> None:
    """One-time costs (first request, buffers for long prompts) out of the measurements."""
    timed_chat(srv, [_msg("user", "Hello.")], max_tokens=2)
    conv = [_msg("system", _system(maker, size, "warm-up")), _msg("user", QUESTIONS[0])]
    r = timed_chat(srv, conv, max_tokens=2)
    timed_chat(srv, [*conv, _msg("assistant", r.text), _msg("user", QUESTIONS[1])], max_tokens=2)


def phase_ttft(srv: ServerProcess, maker: TextMaker, sizes: Sequence[int], repeats: int,
               bar: Progress) -> dict[str, Any]:
    """Cold vs warm time to first token per prefix size, streamed and 1-token."""
    out: dict[str, Any] = {}
    for n in sizes:
        samples: dict[str, list[dict]] = {"stream_cold": [], "stream_warm": [],
                                          "one_token_cold": [], "one_token_warm": []}
        for r in range(repeats):
            for how, send in (("stream", lambda c: stream_chat(srv, c, max_tokens=8)),
                              ("one_token", lambda c: timed_chat(srv, c, max_tokens=1))):
                conv = [_msg("system", _system(maker, n, ("ttft", n, r, how))),
                        _msg("user", QUESTIONS[r % len(QUESTIONS)])]
                cold = send(conv)
                conv += [_msg("assistant", cold.text),
                         _msg("user", QUESTIONS[(r + 1) % len(QUESTIONS)])]
                warm = send(conv)
                samples[f"{how}_cold"].append(cold.to_dict())
                samples[f"{how}_warm"].append(warm.to_dict())
                bar.update(2)
        summary: dict[str, Any] = {"prefix_tokens": n}
        for key, rows in samples.items():
            summary[f"{key}_s"] = _median([x["ttft_s"] for x in rows])
            summary[f"{key}_prompt_tokens"] = _median([x["prompt_tokens"] for x in rows])
            summary[f"{key}_cached_tokens"] = _median([x["cached_tokens"] for x in rows])
        for how in ("stream", "one_token"):
            summary[f"{how}_speedup"] = _ratio(summary[f"{how}_cold_s"], summary[f"{how}_warm_s"])
        summary["samples"] = samples
        out[str(n)] = summary
    return out


def phase_memory(srv: ServerProcess, maker: TextMaker, sampler: RssSampler, *, kvplugin: bool,
                 conversations: int, turns: int, prefix: int, max_tokens: int,
                 bar: Progress) -> dict[str, Any]:
    """Round-robin multi-turn conversations; RSS over time and per request.

    The first round (one cold request per conversation) prefills the long prefixes, whose
    activations are a large transient of their own; every later round reuses the cache.
    Growth "over reuse" is measured from the end of the first round.
    """
    convs = [[_msg("system", _system(maker, prefix, ("memory", c)))] for c in range(conversations)]
    requests: list[dict[str, Any]] = []
    time.sleep(0.2)  # a few samples before the first request
    t_start = sampler.now()
    rss_start = sampler.current()
    stats0 = (get_stats(srv) or {}) if kvplugin else {}
    rss_after_cold = t_after_cold = store_after_cold = None
    for t in range(turns):
        for c, conv in enumerate(convs):
            question = QUESTIONS[(c + t) % len(QUESTIONS)]
            conv.append(_msg("user", f"Visitor {c}, turn {t}: {question}"))
            t0 = sampler.now()
            reply = timed_chat(srv, conv, max_tokens=max_tokens)
            t1 = sampler.now()
            conv.append(_msg("assistant", reply.text))
            row = {"conversation": c, "turn": t, "t_start": t0 - t_start, "t_end": t1 - t_start,
                   "seconds": reply.total_s, "prompt_tokens": reply.prompt_tokens,
                   "cached_tokens": reply.cached_tokens}
            if kvplugin:
                stats = get_stats(srv) or {}
                row["store_bytes"] = stats.get("store_bytes")
                row["store_entries"] = stats.get("store_entries")
            requests.append(row)
            bar.update(1)
        if t == 0:
            time.sleep(0.2)
            t_after_cold = sampler.now() - t_start
            rss_after_cold = sampler.current()
            store_after_cold = requests[-1].get("store_bytes")
    time.sleep(0.3)  # let the last insert (and its memory) settle
    t_end = sampler.now()
    rss_end = sampler.current()
    _, hwm = read_memory(sampler.pid)
    window = sampler.window(t_start - 0.2, t_end)
    series = [(round(t - t_start, 3), r) for t, r in window]
    for row in requests:
        peak = [r for t, r in window if row["t_start"] <= t - t_start <= row["t_end"] + 0.05]
        row["rss_peak"] = max(peak) if peak else None
    reuse = [r for t, r in series if t_after_cold is not None and t >= t_after_cold]
    rss_values = [r for _, r in series]

    def diff(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else a - b

    out: dict[str, Any] = {
        "conversations": conversations, "turns": turns, "prefix_tokens": prefix,
        "max_tokens": max_tokens,
        "rss_start": rss_start, "rss_after_cold": rss_after_cold, "rss_end": rss_end,
        "rss_peak": max(rss_values) if rss_values else None,
        "rss_reuse_peak": max(reuse) if reuse else None,
        "t_after_cold": t_after_cold, "vm_hwm": hwm, "seconds": t_end - t_start,
        "requests": requests, "series": series,
        "cached_tokens_total": sum(r["cached_tokens"] or 0 for r in requests),
    }
    out["rss_growth"] = diff(rss_end, rss_start)
    out["rss_peak_growth"] = diff(out["rss_peak"], rss_start)
    out["rss_reuse_growth"] = diff(rss_end, rss_after_cold)
    out["rss_reuse_peak_growth"] = diff(out["rss_reuse_peak"], rss_after_cold)
    if kvplugin:
        stats = get_stats(srv) or {}
        out["store_bytes_start"] = stats0.get("store_bytes")
        out["store_bytes_after_cold"] = store_after_cold
        out["store_bytes"] = stats.get("store_bytes")
        out["store_entries"] = stats.get("store_entries")
        out["store_growth"] = diff(out["store_bytes"], out["store_bytes_start"])
        out["store_reuse_growth"] = diff(out["store_bytes"], store_after_cold)
        for key in ("store_moved", "store_copied", "store_hits"):
            out[key] = diff(stats.get(key), stats0.get(key))
    return out


def phase_fit(srv: ServerProcess, maker: TextMaker, *, budget: int, prefix: int, max_n: int,
              kvplugin: bool, bar: Progress) -> dict[str, Any]:
    """Largest n such that after n new conversations the first one still hits the cache.

    Conversations are plain completions whose prompts start with pairwise different first
    tokens: no two share even one token, so no request can touch another conversation's
    entry (chat prompts all share the template's first tokens, and a prefix hit on them
    refreshes or copies some other entry). Every round uses fresh conversations; what is
    left from earlier rounds is older, so it is evicted first.
    """
    rounds: list[dict[str, Any]] = []
    starts = iter(maker.starts())
    used: set = set()

    def new_prompt(i: int) -> str:
        for word in starts:
            text = f"{word} " + maker.text(prefix, ("fit", word, i), "notes")
            first = maker.first_token(text)
            if first not in used:
                used.add(first)
                return text
        raise DemoFailed("the tiny model's vocabulary has no more distinct first tokens for "
                         "the conversations-held phase; use a smaller --fit-max")

    def fits(n: int) -> bool:
        prompts, cold_s = [], []
        for i in range(n):
            prompt = new_prompt(i)
            t0 = time.perf_counter()
            r = srv.complete(prompt, max_tokens=1, temperature=0.0)
            cold_s.append(time.perf_counter() - t0)
            prompts.append(prompt + hostproc.answer_text(r))
            bar.update(1)
        before = (get_stats(srv) or {}) if kvplugin else {}
        t0 = time.perf_counter()
        out = srv.complete(prompts[0] + " And then?", max_tokens=1, temperature=0.0)
        seconds = time.perf_counter() - t0
        bar.update(1)
        row: dict[str, Any] = {"n": n, "probe_s": seconds, "cold_s_median": _median(cold_s),
                               "prompt_tokens": (out.get("usage") or {}).get("prompt_tokens")}
        cached = hostproc.cached_tokens(out)
        row["cached_tokens"] = cached
        if kvplugin:
            stats = get_stats(srv) or {}
            row["store_entries"] = stats.get("store_entries")
            row["store_bytes"] = stats.get("store_bytes")
            reused = ((stats.get("store_tokens_reused") or 0)
                      - (before.get("store_tokens_reused") or 0))
            row["tokens_reused"] = reused
        if cached is not None:  # the host reports prompt-cache hits (mlx-lm)
            row["hit"], row["hit_by"] = cached >= 0.9 * prefix, "usage.cached_tokens"
        elif kvplugin:
            row["hit"], row["hit_by"] = row["tokens_reused"] >= 0.9 * prefix, "kvplugin stats"
        else:  # nothing reports hits: a prefill of the whole prefix takes far longer
            row["hit"], row["hit_by"] = seconds < 0.4 * row["cold_s_median"], "timing"
        rounds.append(row)
        return row["hit"]

    lo, hi = 0, max_n  # binary search for the largest n <= max_n that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    held = lo
    out: dict[str, Any] = {
        "budget_bytes": budget, "prefix_tokens": prefix, "max_tried": max_n,
        "conversations_held": held, "saturated": held == max_n, "rounds": rounds,
        "bytes_per_conversation": (budget / held) if held else None,
        "method": "binary search: after n new conversations (completions with distinct first "
                  "tokens), does the first one's continuation hit the cache? (usage.cached_tokens "
                  ">= 90% of the prefix; where the host does not report it: kvplugin's "
                  "tokens_reused, or for stock a probe faster than 0.4x a cold request)",
    }
    if kvplugin:
        stats = get_stats(srv) or {}
        entries = [e for e in stats.get("entries") or () if e.get("tokens", 0) >= prefix]
        out["entry_bytes_mean"] = _median([e.get("nbytes") for e in entries]) if entries else None
        out["entry_dense_bytes_mean"] = (_median([e.get("dense_nbytes") for e in entries])
                                         if entries else None)
        out["entry_tokens_mean"] = _median([e.get("tokens") for e in entries]) if entries else None
        out["stats"] = {k: v for k, v in stats.items() if k != "entries"}
    return out


def _quartiles(xs: Sequence[float]) -> dict[str, float | None]:
    xs = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not xs:
        return {"q1": None, "median": None, "q3": None, "n": 0}
    n = len(xs)
    return {"q1": xs[n // 4], "median": float(statistics.median(xs)), "q3": xs[(3 * n) // 4],
            "n": n}


def phase_decode(servers: Mapping[str, ServerProcess], maker: TextMaker, *, rounds: int,
                 tokens: int, prompt: int, bar: Progress) -> dict[str, Any]:
    """Streamed decode speed, requests alternating between the servers (ABBA order).

    Each round sends the same new prompt to both servers, one after the other; the two
    requests of a round run under nearly the same machine load, so their ratio (``paired``)
    is what load changes on a shared machine disturb least.
    """
    names = list(servers)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(rounds):
        conv = [_msg("user", _system(maker, prompt, ("decode", i)))]
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            pid = servers[name].pid
            c0 = read_cpu_seconds(pid)
            r = stream_chat(servers[name], conv, max_tokens=tokens)
            time.sleep(0.05)  # the request's tail (storing the cache) is server CPU time too
            c1 = read_cpu_seconds(pid)
            row = r.to_dict()
            row["cpu_s"] = None if c0 is None or c1 is None else c1 - c0
            samples[name].append(row)
            bar.update(1)
    out: dict[str, Any] = {"rounds": rounds, "max_tokens": tokens, "prompt_tokens": prompt}
    for name in names:
        rows = samples[name]
        tps = [r["decode_tps"] for r in rows if r["decode_tps"]]
        e2e = [(r["completion_tokens"] or 0) / r["total_s"] for r in rows if r["total_s"]]
        cpu = [r["cpu_s"] for r in rows]
        out[name] = {
            "decode_tps": _median(tps),
            "decode_tps_best": max(tps) if tps else None,
            "e2e_tps": _median(e2e),
            "e2e_tps_best": max(e2e) if e2e else None,
            # tokens per second of the server's own CPU time (its threads; the prefill of
            # the short prompt and the storing of the cache included)
            "tokens_per_cpu_s": _ratio(sum(r["completion_tokens"] or 0 for r in rows),
                                       sum(cpu) if all(c is not None for c in cpu) else None),
            "completion_tokens": _median([r["completion_tokens"] for r in rows]),
            "samples": rows,
        }
    if len(names) == 2:  # kvplugin relative to stock, per round
        a, b = (samples[n] for n in names)  # names == ("stock", "kvplugin")
        out["paired"] = {
            "cpu": _quartiles([x["cpu_s"] / y["cpu_s"] for x, y in zip(a, b)
                               if x["cpu_s"] and y["cpu_s"]]),
            "end_to_end": _quartiles([x["total_s"] / y["total_s"] for x, y in zip(a, b)
                                      if y["total_s"]]),
            "first_last": _quartiles([y["decode_tps"] / x["decode_tps"] for x, y in zip(a, b)
                                      if x["decode_tps"] and y["decode_tps"]]),
        }
    return out


# =============================================================================================
# the run


def _server_env(kind: str, bits: int | None) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVPLUGIN_")}
    if kind == "stock":
        env["KVPLUGIN_DISABLE"] = "1"
    elif bits is not None:
        env.update({"KVPLUGIN_KV_CACHE_QUANTIZATION": "1",
                    "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS": str(bits),
                    "KVPLUGIN_KV_CACHE_MIN_QUANTIZE_TOKENS": "64"})
    return env


class _Servers:
    """Starts servers, remembers them, stops them all (also on Ctrl-C)."""

    def __init__(self, spec: HostSpec, model_dir: Path, host_args: Sequence[str], bits: int | None,
                 progress: bool, startup_timeout: float):
        self.spec, self.model_dir, self.host_args = spec, model_dir, list(host_args)
        self.bits, self.progress, self.startup_timeout = bits, progress, startup_timeout
        self.live: list[ServerProcess] = []
        self.failed: list[ServerProcess] = []

    def start(self, kind: str, extra: Sequence[str] = ()) -> ServerProcess:
        port = hostproc.free_port()
        args = [*extra, *self.host_args]
        env = {**self.spec.env, **_server_env(kind, self.bits)}
        srv = ServerProcess(self.spec.command(self.model_dir, port, args), port=port, env=env,
                            model=self.spec.model, startup_timeout=self.startup_timeout,
                            workdir=tempfile.mkdtemp(prefix=f"kvplugin-bench-{kind}-"),
                            name=f"{self.spec.label} ({kind})")
        self.live.append(srv)
        try:
            with Status(f"starting {kind} {self.spec.label}", enabled=self.progress):
                srv.start()
        except ServerStartError as err:
            self.failed.append(srv)
            raise DemoFailed(f"the {kind} server did not start:\n{err}") from None
        stats = get_stats(srv)
        if kind == "stock" and stats is not None:
            self.failed.append(srv)
            raise DemoFailed("the stock server answers GET /kvplugin/stats: KVPLUGIN_DISABLE=1 "
                             "did not switch kvplugin off")
        if kind == "kvplugin" and stats is None:
            self.failed.append(srv)
            raise DemoFailed(
                f"kvplugin is not active in the kvplugin server (GET /kvplugin/stats does not "
                f"answer); its log: {srv.log_path}\n{srv.log_tail(20)}")
        return srv

    def stop(self, srv: ServerProcess) -> None:
        stop_quietly([srv])
        if srv not in self.failed:  # a failed server's log is kept (and named)
            shutil.rmtree(srv.workdir, ignore_errors=True)
        with contextlib.suppress(ValueError):
            self.live.remove(srv)

    def stop_all(self) -> None:
        stop_quietly(self.live)
        for srv in list(self.live):
            self.stop(srv)
        for srv in self.failed:
            if srv.log_path.exists():
                print(f"kvplugin bench: the log of {srv.name} is kept in {srv.log_path}",
                      file=sys.stderr)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = host_spec(args.host)
    version = spec.check()
    model_dir = prepare_model(args.model_dir, progress=args.progress)
    maker = TextMaker(model_dir)
    bits = None if args.no_quantization else args.kv_bits
    res: dict[str, Any] = {
        "benchmark": "server",
        "config": {
            "host": spec.name, "host_version": version, "quick": args.quick,
            "sizes": args.sizes, "repeats": args.repeats, "conversations": args.conversations,
            "turns": args.turns, "mem_prefix": args.mem_prefix, "mem_tokens": args.mem_tokens,
            "fit_budget": args.fit_budget, "fit_prefix": args.fit_prefix, "fit_max": args.fit_max,
            "decode_rounds": args.decode_rounds, "decode_tokens": args.decode_tokens,
            "decode_prompt": args.decode_prompt, "kv_bits": bits,
            "host_args": list(args.host_args),
            "kvplugin_env": {k: v for k, v in _server_env("kvplugin", bits).items() if v},
            "stock_env": {"KVPLUGIN_DISABLE": "1"},
            "model": "kvplugin tiny model v1 (llama, 2 layers, 2 KV heads x 64, fp16: "
                     "1 KiB of KV per token)",
        },
        "environment": environment(),
        "goal_limits": GOALS,
        "stock": {}, "kvplugin": {},
    }
    t_run = time.perf_counter()
    servers = _Servers(spec, model_dir, args.host_args, bits, args.progress, args.startup_timeout)
    kinds = ("stock", "kvplugin")
    live: dict[str, ServerProcess] = {}
    samplers: dict[str, RssSampler] = {}
    try:
        main_args = spec.budget_args(args.main_budget)
        try:
            for kind in kinds:  # one after the other; both stay up for the interleaved decode
                live[kind] = servers.start(kind, main_args)
                samplers[kind] = RssSampler(live[kind].pid).start()
            per_server = 3 + 4 * len(args.sizes) * args.repeats + args.conversations * args.turns
            for kind in kinds:
                srv = live[kind]
                with Progress(per_server, f"{kind}: ttft, memory", enabled=args.progress) as bar:
                    warm_up(srv, maker, max(args.sizes))
                    bar.update(3)
                    res[kind]["startup_s"] = srv.startup_seconds
                    res[kind]["ttft"] = phase_ttft(srv, maker, args.sizes, args.repeats, bar)
                    res[kind]["memory"] = phase_memory(
                        srv, maker, samplers[kind], kvplugin=kind == "kvplugin",
                        conversations=args.conversations, turns=args.turns,
                        prefix=args.mem_prefix, max_tokens=args.mem_tokens, bar=bar)
            with Progress(2 * args.decode_rounds, "decode (interleaved)",
                          enabled=args.progress) as bar:
                decode = phase_decode(live, maker, rounds=args.decode_rounds,
                                      tokens=args.decode_tokens, prompt=args.decode_prompt, bar=bar)
            for kind in kinds:
                res[kind]["decode"] = decode[kind]
            res["decode_paired"] = decode.get("paired")
            stats = get_stats(live["kvplugin"]) or {}
            res["kvplugin"]["stats"] = {k: v for k, v in stats.items() if k != "entries"}
            res["kvplugin"]["entries_sample"] = (stats.get("entries") or [])[-4:]
            for kind in kinds:
                _, hwm = read_memory(live[kind].pid)
                res[kind]["vm_hwm"] = hwm
        finally:
            for s in samplers.values():
                s.stop()
            for kind in kinds:
                if kind in live:
                    servers.stop(live[kind])
        for kind in kinds:
            srv = servers.start(kind, spec.budget_args(args.fit_budget))
            steps = max(1, math.ceil(math.log2(args.fit_max + 1))) * (args.fit_max // 2 + 2)
            with Progress(steps, f"{kind}: conversations in budget",
                          enabled=args.progress) as bar:
                res[kind]["fit"] = phase_fit(srv, maker, budget=args.fit_budget,
                                             prefix=args.fit_prefix, max_n=args.fit_max,
                                             kvplugin=kind == "kvplugin", bar=bar)
            servers.stop(srv)
    finally:
        servers.stop_all()
    res["elapsed_s"] = time.perf_counter() - t_run
    res["ratios"] = ratios(res)
    res["goals"] = [g.to_dict() for g in goals(res)]
    return res


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
            "warm_kvplugin_over_stock_stream": _ratio(k["stream_warm_s"], s["stream_warm_s"]),
            "cold_kvplugin_over_stock_stream": _ratio(k["stream_cold_s"], s["stream_cold_s"]),
        }
    sm, km = st["memory"], kv["memory"]
    out["memory"] = {
        "rss_reuse_growth_kvplugin_over_stock": _ratio(km["rss_reuse_growth"],
                                                       sm["rss_reuse_growth"]),
        "rss_growth_kvplugin_over_stock": _ratio(km["rss_growth"], sm["rss_growth"]),
        "rss_peak_growth_kvplugin_over_stock": _ratio(km["rss_peak_growth"],
                                                      sm["rss_peak_growth"]),
        "rss_end_kvplugin_over_stock": _ratio(km["rss_end"], sm["rss_end"]),
    }
    sf, kf = st["fit"], kv["fit"]
    out["fit"] = {
        "conversations_held_kvplugin_over_stock": _ratio(kf["conversations_held"],
                                                         sf["conversations_held"]),
        "bytes_per_conversation_kvplugin_over_stock": _ratio(kf["bytes_per_conversation"],
                                                             sf["bytes_per_conversation"]),
        "entry_stored_over_fp16": _ratio(kf.get("entry_bytes_mean"),
                                         kf.get("entry_dense_bytes_mean")),
    }
    kd, sd = kv["decode"], st["decode"]
    paired = res.get("decode_paired") or {}
    out["decode"] = {
        "paired_cpu_median": (paired.get("cpu") or {}).get("median"),
        "paired_end_to_end_median": (paired.get("end_to_end") or {}).get("median"),
        "paired_first_last_median": (paired.get("first_last") or {}).get("median"),
        "tokens_per_cpu_s_kvplugin_over_stock": _ratio(kd.get("tokens_per_cpu_s"),
                                                       sd.get("tokens_per_cpu_s")),
        "median_decode_tps_kvplugin_over_stock": _ratio(kd["decode_tps"], sd["decode_tps"]),
        "best_decode_tps_kvplugin_over_stock": _ratio(kd["decode_tps_best"], sd["decode_tps_best"]),
        "median_e2e_tps_kvplugin_over_stock": _ratio(kd["e2e_tps"], sd["e2e_tps"]),
    }
    return out


def goals(res: Mapping[str, Any]) -> list[Goal]:
    cfg = res["config"]
    size = str(max(cfg["sizes"]))
    r = res["ratios"]
    k = res["kvplugin"]["ttft"][size]
    st = res["stock"]["ttft"][size]
    note = (f"kvplugin server, {size}-token prefix, streamed first token, median of "
            f"{cfg['repeats']}: cold {_ms(k['stream_cold_s'])}, warm {_ms(k['stream_warm_s'])} "
            f"(stock: {_x(st['stream_speedup'])}; 1-token requests: kvplugin "
            f"{_x(k['one_token_speedup'])}, stock {_x(st['one_token_speedup'])})")
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
              f"{_x(rd['tokens_per_cpu_s_kvplugin_over_stock'], 3)}, median first-to-last rate "
              f"{_x(rd['median_decode_tps_kvplugin_over_stock'], 3)}")
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
                         _ms(s[f"{how}_cold_s"]), _ms(s[f"{how}_warm_s"]), _x(s[f"{how}_speedup"]),
                         _ms(k[f"{how}_cold_s"]), _ms(k[f"{how}_warm_s"]), _x(k[f"{how}_speedup"]),
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


# =============================================================================================
# command line


def _sizes(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of token counts: {text!r}") from None
    if not out or any(n < 32 for n in out):
        raise argparse.ArgumentTypeError("prefix sizes must be >= 32 tokens")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplugin bench --server",
        description="Server-level benchmark: the stock host (KVPLUGIN_DISABLE=1) vs the "
                    "kvplugin host, real processes on the tiny local model: warm vs cold "
                    "time to first token, memory across reuse, conversations held in a "
                    "budget, decode throughput.",
        epilog="Extra host arguments (given to both servers) go after `--`.",
    )
    p.add_argument("--host", choices=HOSTS, default="mlx-lm", help="default: mlx-lm")
    p.add_argument("--kv-bits", type=int, choices=range(2, 9), default=8, metavar="{2..8}",
                   help="kvplugin's --kv-cache-quantization-bits (default 8)")
    p.add_argument("--no-quantization", action="store_true",
                   help="kvplugin stores fp16 entries (trimmed only)")
    p.add_argument("--sizes", type=_sizes, default=None,
                   help="prefix lengths for time to first token, comma separated "
                        f"(default {','.join(map(str, DEFAULTS['sizes']))})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"cold/warm pairs per size (default {DEFAULTS['repeats']})")
    p.add_argument("--conversations", type=int, default=None,
                   help=f"conversations in the memory phase (default {DEFAULTS['conversations']})")
    p.add_argument("--turns", type=int, default=None,
                   help=f"turns per conversation in the memory phase (default {DEFAULTS['turns']})")
    p.add_argument("--mem-prefix", type=int, default=None,
                   help="system prompt tokens in the memory phase "
                        f"(default {DEFAULTS['mem_prefix']})")
    p.add_argument("--mem-tokens", type=int, default=None,
                   help=f"tokens generated per turn in the memory phase "
                        f"(default {DEFAULTS['mem_tokens']})")
    p.add_argument("--fit-budget", type=parse_size, default=None, metavar="SIZE",
                   help="prompt-cache budget of the conversations-held phase (default 8M = "
                        "8 MiB; K/M/G are binary)")
    p.add_argument("--fit-prefix", type=int, default=None,
                   help="system prompt tokens per conversation there "
                        f"(default {DEFAULTS['fit_prefix']})")
    p.add_argument("--fit-max", type=int, default=None,
                   help=f"most conversations tried (default {DEFAULTS['fit_max']})")
    p.add_argument("--decode-rounds", type=int, default=None,
                   help=f"decode requests per server (default {DEFAULTS['decode_rounds']})")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help=f"max_tokens of each decode request (default {DEFAULTS['decode_tokens']})")
    p.add_argument("--decode-prompt", type=int, default=None,
                   help="prompt tokens of each decode request "
                        f"(default {DEFAULTS['decode_prompt']})")
    p.add_argument("--main-budget", type=parse_size, default=1 << 30, metavar="SIZE",
                   help="prompt-cache budget of the TTFT/memory/decode servers (default 1G: "
                        "nothing is evicted there)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the tiny model (built there if missing; default as `kvplugin demo`)")
    p.add_argument("--startup-timeout", type=float, default=180.0, metavar="S")
    p.add_argument("--out", type=Path, default=Path("kvplugin-bench"),
                   help="directory for server.json and the PNG plots (default ./kvplugin-bench)")
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute; the tests)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("host_args", nargs="*", metavar="-- HOST_ARGS",
                   help="extra arguments for both host servers, after `--`")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, list(v) if isinstance(v, list) else v)
    for k in ("repeats", "conversations", "turns", "fit_max", "decode_rounds", "decode_tokens"):
        if getattr(args, k) < 1:
            raise SystemExit(f"kvplugin bench --server: --{k.replace('_', '-')} must be >= 1")
    if args.decode_tokens < 2:
        raise SystemExit("kvplugin bench --server: --decode-tokens must be >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _resolve(build_parser().parse_args(argv))
    with cleanup_signals():
        try:
            res = run(args)
        except KeyboardInterrupt:
            print("\nkvplugin bench: interrupted; every server was stopped.", file=sys.stderr)
            return 130
        except (DemoFailed, HostNotInstalled) as err:
            print(f"kvplugin bench: {err}", file=sys.stderr)
            return 1
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    res["plots"] = make_plots(res, out) if args.plots else {}
    cfg, env = res["config"], res["environment"]
    print(f"kvplugin server bench - {cfg['host']} {cfg['host_version']}, tiny model, "
          f"kvplugin entries {cfg['kv_bits'] or 16}-bit, device {env.get('mlx_device', '?')} "
          f"({env.get('cpu_count')} CPUs), {res['elapsed_s']:.0f} s\n")
    print(tables(res))
    print()
    print(goals_table([Goal(**{k: v for k, v in g.items() if k not in ("verdict", "met")})
                       for g in res["goals"]], "Goals (issue 6, server level)"))
    save_results(out / "server.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
