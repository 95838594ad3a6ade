"""A real ``redis-server`` on 127.0.0.1 for tests and ``kvplugin bench --remote``.

Why a helper and not a mock: the remote tier's promises (timeouts, a server that stops
mid-run, a full instance, a corrupted value) are about a real server's behaviour. The
process runs with no persistence, in its own directory, on a free port.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvplugin.tools.hostcmd import HOST, free_port

__all__ = ["RedisNotInstalled", "RedisServer"]

INSTALL_HINT = ("redis-server is not installed: apt-get install redis-server (Debian/Ubuntu), "
                "brew install redis (macOS); `bash .ci/run` installs it")


class RedisNotInstalled(RuntimeError):
    """``redis-server`` is not on PATH (tests fail with this, never skip)."""


class RedisServer:
    """``with RedisServer() as r: r.url`` -- a fresh redis-server, stopped at exit."""

    def __init__(self, *, password: str | None = None, maxmemory: str | None = None,
                 policy: str = "allkeys-lru", unix_socket: bool = False) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisNotInstalled(INSTALL_HINT)
        self.exe = exe
        self.password = password
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = 0
        self.dir = Path(tempfile.mkdtemp(prefix="kvplugin-redis-"))
        self.proc: subprocess.Popen | None = None
        self.socket = self.dir / "redis.sock" if unix_socket else None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.socket is not None:
            return f"unix://{auth}{self.socket}?db=0"
        return f"redis://{auth}{HOST}:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or restart, on the same port) and wait until it answers PING."""
        self.port = self.port or free_port()
        cmd = [self.exe, "--port", str(self.port), "--bind", HOST, "--save", "",
               "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "yes"]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.socket is not None:
            cmd += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {err}")
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def client(self):
        """A ``redis.Redis`` on this server (the test's own view of it)."""
        import redis

        return redis.Redis(host=HOST, port=self.port, password=self.password,
                           socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
