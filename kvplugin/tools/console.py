"""What the tools print on stderr and how they stop their servers on every way out.

A status line (spinner on a terminal), ``kvplugin:``-prefixed messages, SIGTERM turned into
``SystemExit(143)`` so ``finally`` blocks run, servers stopped with Ctrl-C ignored meanwhile,
and the K/M/G size parser of the command lines.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import threading
import time
from typing import Any, Iterator, Sequence

from kvplugin.tools.hostproc import ServerProcess

__all__ = ["KiB", "MiB", "Status", "say", "cleanup_signals", "stop_quietly", "parse_size"]

KiB = 1 << 10
MiB = 1 << 20


class Status:
    """``with Status("starting the server"):`` -- a spinner with elapsed seconds on a
    terminal, or one line when it starts and one when it ends otherwise. stderr only."""

    FRAMES = "|/-\\"

    def __init__(self, message: str, *, enabled: bool = True, stream: Any = None):
        self.message = message
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.note = ""

    def _write(self, text: str) -> None:
        with contextlib.suppress(Exception):
            self.stream.write(text)
            self.stream.flush()

    def _spin(self) -> None:
        i = 0
        while not self._stop.wait(0.1):
            elapsed = time.monotonic() - self._t0
            self._write(f"\r{self.FRAMES[i % 4]} {self.message} ({elapsed:.1f} s){self.note}\033[K")
            i += 1

    def __enter__(self) -> "Status":
        self._t0 = time.monotonic()
        if not self.enabled:
            return self
        if self.tty:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        else:
            self._write(f"kvplugin: {self.message} ...\n")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        elapsed = time.monotonic() - self._t0
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if not self.enabled:
            return
        if exc_type is None:
            verdict = "done"
        elif issubclass(exc_type, KeyboardInterrupt):
            verdict = "interrupted"
        else:
            verdict = "failed"
        if self.tty:
            mark = "+" if exc_type is None else "x"
            self._write(f"\r{mark} {self.message}: {verdict} ({elapsed:.1f} s){self.note}\033[K\n")
        else:
            self._write(f"kvplugin: {self.message}: {verdict} ({elapsed:.1f} s){self.note}\n")


def say(message: str) -> None:
    print(f"kvplugin: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def cleanup_signals() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` and SIGINT ``KeyboardInterrupt`` (so ``finally``
    blocks stop the server); restored afterwards.

    SIGINT gets Python's own handler installed explicitly: a process started in the
    background (``cmd &``, a CI job) inherits SIGINT *ignored*, and Python keeps an inherited
    "ignore", so without this Ctrl-C (or ``kill -INT``) would do nothing there.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def stop_quietly(servers: Sequence[ServerProcess | None]) -> None:
    """Stop servers with SIGINT/SIGTERM ignored meanwhile (a second Ctrl-C must not leave
    a half-stopped server behind)."""
    main = threading.current_thread() is threading.main_thread()
    old = {}
    if main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        for srv in servers:
            if srv is not None:
                with contextlib.suppress(Exception):
                    srv.stop()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G, 500000)")
    scale = {"": 1, "k": KiB, "m": MiB, "g": 1 << 30}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value
