"""The server benchmark's workloads: what is sent to a host process and what is measured.

Each ``phase_*`` drives one running server (or a pair) through the OpenAI API and returns
plain numbers; process memory and CPU time are read from outside (``/proc``, ``ps``).
:mod:`kvplugin.tools.bench.server` orders the phases and writes the results.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import threading
import time
from typing import Any, Mapping, Sequence

from kvplugin.tools import hostproc
from kvplugin.tools.bench.report import Progress
from kvplugin.tools.client import get_stats, stream_chat, timed_chat
from kvplugin.tools.hostproc import ServerProcess
from kvplugin.tools.launch import DemoFailed
from kvplugin.tools.prompts import QUESTIONS, TextMaker

KiB = 1 << 10
MiB = 1 << 20
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


def _cpu_seconds(pids: set[int]) -> float | None:
    seconds = [read_cpu_seconds(p) for p in pids]
    return None if None in seconds else sum(seconds)


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


def model_pid(pid: int) -> int:
    """The process that holds the model: ``pid``, or the largest of its child processes for a
    host that runs its model in one (mlx-openai-server spawns a process per model)."""
    children: list[int] = []
    for task in (os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ()):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:
            continue
    sized = [(read_memory(c)[0] or 0, c) for c in children]
    return max(sized)[1] if sized else pid


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


def safe_ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _system(maker: TextMaker, n: int, seed: Any) -> str:
    return maker.text(n, seed, "Notes")


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def fmt_x(x: float | None, digits: int = 1) -> str:
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
            summary[f"{how}_speedup"] = safe_ratio(summary[f"{how}_cold_s"], summary[f"{how}_warm_s"])
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

    # a host without /v1/completions (mlx-openai-server): the same texts as chat turns
    chat = srv.request("GET", "/v1/completions")[0] == 404

    def ask(conversation: Any) -> dict:
        if chat:
            return srv.chat(conversation, max_tokens=1, temperature=0.0)
        return srv.complete(conversation, max_tokens=1, temperature=0.0)

    def fits(n: int) -> bool:
        prompts: list[Any] = []
        cold_s = []
        for i in range(n):
            prompt = new_prompt(i)
            t0 = time.perf_counter()
            r = ask([_msg("user", prompt)] if chat else prompt)
            cold_s.append(time.perf_counter() - t0)
            answer = hostproc.answer_text(r)
            prompts.append([_msg("user", prompt), _msg("assistant", answer)] if chat
                           else prompt + answer)
            bar.update(1)
        before = (get_stats(srv) or {}) if kvplugin else {}
        t0 = time.perf_counter()
        out = ask([*prompts[0], _msg("user", "And then?")] if chat
                  else prompts[0] + " And then?")
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
            pids = {servers[name].pid, model_pid(servers[name].pid)}  # and its model process
            c0 = _cpu_seconds(pids)
            r = stream_chat(servers[name], conv, max_tokens=tokens)
            time.sleep(0.05)  # the request's tail (storing the cache) is server CPU time too
            c1 = _cpu_seconds(pids)
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
            "tokens_per_cpu_s": safe_ratio(sum(r["completion_tokens"] or 0 for r in rows),
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
