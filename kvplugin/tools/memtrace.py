"""Run a host server with an in-process memory recorder: ``python -m kvplugin.tools.memtrace``.

Why in-process: MLX's allocator figures (active, peak, buffer cache) exist only inside the
server, and a reuse transient lasts milliseconds, so polling ``/proc`` from outside misses
it. The recorder samples every few milliseconds and, between samples, lets MLX's own peak
counter catch whatever happened (it reads ``mx.get_peak_memory()`` and resets it each
time), so no transient falls between two samples.

It wraps nothing of the host: the same command runs a stock server (``KVPLUGIN_DISABLE=1``)
and a kvplugin one, and the figures of both come from the same code. When kvplugin is
active, it also subscribes to kvplugin's ``kvplugin_cache_event`` hook (if that hook
exists), so each trace line carries the cache event it happened at; a stock server gets its
events from the client's request marks instead.

Usage::

    python -m kvplugin.tools.memtrace --out trace.jsonl [--interval 0.002] -- \\
        mlx_lm.server --model DIR --port 8080

Each line of ``trace.jsonl`` is one JSON object: ``t`` (epoch seconds), ``kind``
(``sample`` or ``event``), ``name`` (the event), ``active``, ``peak`` (the MLX peak since
the previous line), ``cache`` (MLX's buffer cache), ``hwm`` and ``rss`` (``VmHWM``/``VmRSS``
of the process), all in bytes, plus the event's own fields.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import sys
import threading
import time
from importlib import metadata
from typing import IO, Any, Callable

_CALL = operator.methodcaller("__call__")


def _proc_status() -> dict[str, int]:
    """VmHWM and VmRSS of this process in bytes (Linux; zeros elsewhere)."""
    out = {"hwm": 0, "rss": 0}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    out["hwm"] = int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    out["rss"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


class Recorder:
    """Writes one JSON line per sample or event; thread-safe."""

    def __init__(self, out: IO[str]) -> None:
        import mlx.core as mx

        self._mx = mx
        self._out = out
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def record(self, kind: str, name: str = "", **fields: Any) -> None:
        mx = self._mx
        with self._lock:
            active = mx.get_active_memory()
            # The peak is read and reset in one C-level pass (unpacking a map runs no Python
            # bytecode between the two calls). As two statements, the interpreter could hand
            # the GIL to a host thread between them for a switch interval, and a transient
            # allocated and freed meanwhile was wiped by the reset: a stock server's process
            # peak once read 0.23 MiB low that way under CI load. MLX's reset sets the peak
            # to 0, so with no allocation since the last sample it reads 0; the peak between
            # two samples is never below what is held now.
            peak, _ = map(_CALL, (mx.get_peak_memory, mx.reset_peak_memory))
            peak = max(peak, active)
            line = {
                "t": time.time(),
                "kind": kind,
                "name": name,
                "active": active,
                "peak": peak,
                "cache": mx.get_cache_memory(),
                **_proc_status(),
                **fields,
            }
            self._out.write(json.dumps(line) + "\n")
            self._out.flush()

    def sample_forever(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.record("sample")

    def stop(self) -> None:
        self._stop.set()


def _subscribe_to_kvplugin(recorder: Recorder) -> None:
    """Mark kvplugin's cache events in the trace, when kvplugin is active and has the hook."""
    try:
        from kvplugin.hookspecs import hookimpl
        from kvplugin.plugins import get_plugin_manager
    except ImportError:
        return

    class _EventMarks:
        @hookimpl
        def kvplugin_cache_event(self, event: str, tokens: int, nbytes: int,
                                 seconds: float) -> None:
            recorder.record("event", event, tokens=tokens, nbytes=nbytes, seconds=seconds)

    pm = get_plugin_manager()
    if hasattr(pm.hook, "kvplugin_cache_event"):
        pm.register(_EventMarks(), name="memtrace")


def _console_script(name: str) -> Callable[[], Any]:
    found = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == name]
    if not found:
        raise SystemExit(f"memtrace: no console script named {name!r} is installed")
    return found[0].load()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvplugin.tools.memtrace")
    parser.add_argument("--out", required=True, help="JSON-lines trace file to write")
    parser.add_argument("--interval", type=float, default=0.002, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the host's console script after --")
    out = open(args.out, "a", buffering=1)
    recorder = Recorder(out)
    recorder.record("event", "start", pid=os.getpid())
    threading.Thread(target=recorder.sample_forever, args=(args.interval,), daemon=True).start()
    entry = _console_script(command[0])
    # Host modules are imported by entry.load() above, so kvplugin (if active) is
    # installed by now and its plugin manager exists.
    if os.environ.get("KVPLUGIN_DISABLE", "").strip().lower() not in {"1", "true", "yes", "on"}:
        _subscribe_to_kvplugin(recorder)
    sys.argv = list(command)
    try:
        result = entry()
    finally:
        recorder.record("event", "exit")
        recorder.stop()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
