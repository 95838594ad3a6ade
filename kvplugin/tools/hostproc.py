"""Run real host servers (``mlx_lm.server``, ``vllm-mlx serve``) on 127.0.0.1.

Stdlib only: ``kvplugin demo``, ``kvplugin bench`` and the integration tests (through
``integration/harness.py``) all drive hosts with it; the command lines and the sealed
environment come from :mod:`kvplugin.tools.hostcmd`.

Every child runs in its own session/process group. ``stop()`` sends SIGTERM to the group,
then SIGKILL after a grace period; an ``atexit`` guard kills whatever is still running when
the interpreter exits, and on Linux a server also gets SIGKILL if its parent dies
(PR_SET_PDEATHSIG). :class:`ServerProcess` sends ``model`` only when one is set.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvplugin.tools.hostcmd import HOST, server_env

__all__ = [
    "ServerStartError",
    "ServerHTTPError",
    "ServerProcess",
    "run_command",
    "default_ready_check",
    "answer_text",
    "cached_tokens",
]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time (message has the log tail)."""


class ServerHTTPError(RuntimeError):
    """Non-2xx answer. ``status`` and ``body`` (decoded JSON or text) are attached."""

    def __init__(self, method: str, url: str, status: int, body: Any,
                 headers: Mapping[str, str] | None = None):
        self.status, self.body, self.url = status, body, url
        self.headers = headers if headers is not None else {}  # case-insensitive from HTTP
        text = body if isinstance(body, str) else json.dumps(body)
        super().__init__(f"{method} {url} -> HTTP {status}: {text[:2000]}")


# --------------------------------------------------------------------------- #
# reading answers, readiness, process groups


def answer_text(response: Mapping[str, Any]) -> str:
    """The text of the first choice of a chat or completion response."""
    choice = response["choices"][0]
    if "message" in choice:
        return choice["message"].get("content") or ""
    return choice.get("text") or ""


def cached_tokens(response: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (mlx-lm >= 0.31 and vllm-mlx
    report prompt-cache hits there), or None when absent."""
    usage = response.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


_TRACEBACK_GRACE = 10.0
_POLL_LINE = re.compile(r'"GET /(health|v1/models) HTTP/1\.[01]" \d{3}')


def default_ready_check(server: "ServerProcess") -> tuple[bool, str]:
    """Ready = ``GET /health`` is 200 (or 404: no such route) **and** ``GET
    /v1/models`` lists at least one model.

    The second half matters: when ``mlx_lm.server`` cannot load its model the
    HTTP server keeps running with a dead generation thread; ``/health`` then
    says 503 (0.32.x) or still 200 (0.31.x), and ``/v1/models`` lists nothing.
    """
    status, body = server.request("GET", "/health", timeout=5)
    if status not in (200, 404):
        return False, f"GET /health: HTTP {status} {body!r:.200}"
    status, body = server.request("GET", "/v1/models", timeout=5)
    if status != 200:
        return False, f"GET /v1/models: HTTP {status} {body!r:.200}"
    if not (isinstance(body, dict) and body.get("data")):
        return False, f"GET /v1/models lists no model: {body!r:.200}"
    return True, "ready"


def _parent_death_preexec() -> Callable[[], None] | None:
    """Linux: make the child get SIGKILL if the process that started it dies
    without cleaning up (pytest killed by SIGKILL/SIGTERM, where atexit never
    runs). Best effort; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # parent already gone
            os._exit(1)

    return preexec


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# --------------------------------------------------------------------------- #
# the server process

_LIVE: set["ServerProcess"] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _kill_leftovers() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for srv in live:
        with contextlib.suppress(Exception):
            srv.stop(grace=2.0)


def _port_from_args(args: Sequence[str]) -> int | None:
    for i, a in enumerate(args):
        if a == "--port" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--port="):
            return int(a.split("=", 1)[1])
    return None


class ServerProcess:
    """One server child process, from start to a guaranteed stop.

    ``ServerProcess(args, ...)`` does nothing until :meth:`start` (or ``with``).
    ``port`` defaults to the ``--port`` value in ``args``. ``workdir`` (created
    if needed; a fresh temp dir if None, removed by :meth:`close` unless the
    start failed) holds ``home/`` (the child's ``HOME``) and ``server.log``;
    it is the child's cwd. ``model`` is sent as the request's ``"model"`` when
    not None. ``ready_check(server) -> (ready, why)`` is polled every 0.2 s
    until it says ready (default :func:`default_ready_check`); start fails
    loudly (:class:`ServerStartError`, with the log tail) if the process exits,
    if ``startup_timeout`` passes, or if the log shows a traceback and the
    server is still not ready 10 s later.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        port: int | None = None,
        env: Mapping[str, str | None] | None = None,
        workdir: Path | str | None = None,
        model: str | None = None,
        startup_timeout: float = 120.0,
        request_timeout: float = 300.0,
        ready_check: Callable[["ServerProcess"], tuple[bool, str]] | None = None,
        name: str | None = None,
    ):
        self.args = [str(a) for a in args]
        port = port if port is not None else _port_from_args(self.args)
        if port is None:
            raise ValueError("no port given and no --port in args")
        self.port = int(port)
        self.url = f"http://{HOST}:{self.port}"
        self.model = model
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.ready_check = ready_check or default_ready_check
        self.name = name or Path(self.args[0]).name
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(
            tempfile.mkdtemp(prefix="kvplugin-server-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home = self.workdir / "home"
        self.home.mkdir(exist_ok=True)
        self.log_path = self.workdir / "server.log"
        self.env = server_env(self.home, env)
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.startup_seconds: float | None = None
        self._log_fh = None

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> "ServerProcess":
        if self.proc is not None:
            raise RuntimeError("already started")
        self._log_fh = open(self.log_path, "ab")
        self._log_fh.write(("$ " + " ".join(self.args) + "\n").encode())
        self._log_fh.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.args, env=self.env, cwd=self.workdir, stdin=subprocess.DEVNULL,
            stdout=self._log_fh, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_parent_death_preexec(),
        )
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop(grace=3.0)
            self._own_workdir = False  # keep the log for the post-mortem
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        last = "no answer yet"
        traceback_seen_at = None
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(
                    f"{self.name} exited with {rc} before becoming ready on {self.url}\n"
                    f"log ({self.log_path}) tail:\n{self.log_tail()}")
            try:
                ok, last = self.ready_check(self)
            except (OSError, ValueError) as e:  # refused, reset, timeout
                ok, last = False, f"{type(e).__name__}: {e}"
            if ok:
                return
            now = time.monotonic()
            if traceback_seen_at is None and "Traceback (most recent call last)" in self.log_text():
                traceback_seen_at = now
            if traceback_seen_at is not None and now - traceback_seen_at > _TRACEBACK_GRACE:
                raise ServerStartError(
                    f"{self.name} logged a traceback and is not ready on {self.url} "
                    f"{_TRACEBACK_GRACE:.0f}s later ({last})\n"
                    f"log ({self.log_path}) tail:\n{self.log_tail()}")
            if now > deadline:
                raise ServerStartError(
                    f"{self.name} not ready on {self.url} after {self.startup_timeout:.0f}s "
                    f"({last})\nlog ({self.log_path}) tail:\n{self.log_tail()}")
            time.sleep(0.2)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; returns
        the exit code (negative = killed by that signal; None if never started).
        Idempotent. Any other member of the group is SIGKILLed at the end."""
        if self.proc is None:
            return None
        if self.returncode is None:
            pgid = self.proc.pid  # start_new_session: pgid == pid
            if self.proc.poll() is None:
                _kill_group(pgid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    _kill_group(pgid, signal.SIGKILL)
                    self.proc.wait(timeout=30)
            _kill_group(pgid, signal.SIGKILL)  # stragglers (workers, resource trackers)
            self.returncode = self.proc.returncode
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return self.returncode

    def close(self) -> int | None:
        """:meth:`stop`, then remove an own temp workdir."""
        rc = self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return rc

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ServerProcess {self.name} {self.url} pid={self.pid} rc={self.returncode}>"

    # -- logs --------------------------------------------------------------
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60, *, skip_polls: bool = True) -> str:
        """Last ``lines`` log lines; ``skip_polls`` drops the access-log lines of
        the readiness polls (``GET /health``, ``GET /v1/models``)."""
        text = self.log_text().splitlines()
        if skip_polls:
            text = [ln for ln in text if not _POLL_LINE.search(ln)]
        return "\n".join(text[-lines:])

    # -- HTTP --------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None,
                timeout: float | None = None) -> tuple[int, Any]:
        """Any request; returns ``(status, decoded JSON or text)`` without raising
        on HTTP errors (connection errors do raise)."""
        status, decoded, _ = self.exchange(method, path, body, timeout)
        return status, decoded

    def exchange(self, method: str, path: str, body: Any = None,
                 timeout: float | None = None) -> tuple[int, Any, Any]:
        """:meth:`request`, plus the response headers (case-insensitive ``get``)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as r:
                status, raw, headers = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            status, raw, headers = e.code, e.read(), e.headers
        text = raw.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text), headers
        except ValueError:
            return status, text, headers

    def get(self, path: str, timeout: float | None = None) -> Any:
        status, body = self.request("GET", path, timeout=timeout)
        if not 200 <= status < 300:
            raise ServerHTTPError("GET", self.url + path, status, body)
        return body

    def post(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> Any:
        status, out, headers = self.exchange("POST", path, dict(body), timeout=timeout)
        if not 200 <= status < 300:
            raise ServerHTTPError("POST", self.url + path, status, out, headers)
        return out

    def _payload(self, max_tokens: int, temperature: float, seed: int | None,
                 extra: Mapping[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
        if self.model is not None:
            body["model"] = self.model
        if seed is not None:
            body["seed"] = seed
        body.update(extra)
        return body

    def chat(self, messages: Sequence[Mapping[str, Any]] | str, max_tokens: int = 16,
             temperature: float = 0.0, seed: int | None = None,
             timeout: float | None = None, **extra: Any) -> dict:
        """POST ``/v1/chat/completions`` (non-streaming); a str is one user
        message. ``extra`` goes into the body (e.g. ``model=...``, ``top_p``).
        Raises :class:`ServerHTTPError` on non-2xx."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = self._payload(max_tokens, temperature, seed, extra)
        body["messages"] = list(messages)
        return self.post("/v1/chat/completions", body, timeout=timeout)

    def complete(self, prompt: str, max_tokens: int = 16, temperature: float = 0.0,
                 seed: int | None = None, timeout: float | None = None, **extra: Any) -> dict:
        """POST ``/v1/completions`` (non-streaming)."""
        body = self._payload(max_tokens, temperature, seed, extra)
        body["prompt"] = prompt
        return self.post("/v1/completions", body, timeout=timeout)


# --------------------------------------------------------------------------- #
# one-shot commands


def run_command(args: Sequence[str], env: Mapping[str, str | None] | None = None,
                timeout: float = 120.0, *, cwd: Path | str | None = None,
                home: Path | str | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` to completion (``--help``, expected start-up failures) with
    the same environment treatment as :class:`ServerProcess`; text stdout and
    stderr are captured separately. On timeout the whole process group is
    killed and ``subprocess.TimeoutExpired`` is raised."""
    tmp = None
    if home is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvplugin-cmd-")
        home = Path(tmp.name) / "home"
    Path(home).mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen(
            [str(a) for a in args], env=server_env(home, env), cwd=cwd or home,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, errors="replace", start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        finally:
            _kill_group(proc.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if tmp is not None:
            tmp.cleanup()
