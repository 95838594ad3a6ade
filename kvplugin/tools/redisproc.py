"""A real ``redis-server`` on 127.0.0.1 for tests and ``kvplugin bench --remote``.

Why a helper and not a mock: the remote tier's promises (timeouts, a server that stops
mid-run, a full instance, a corrupted value, TLS and ACL users) are about a real server's
behaviour. The process runs with no persistence, in its own directory, on a free port, from a
configuration file written there (a password never appears on its command line). ``tls=True``
serves TLS only, with a certificate made at start by ``openssl`` for 127.0.0.1 and signed by a
throw-away CA (:attr:`RedisServer.ca_file`, what a client must trust).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from kvplugin.tools.hostcmd import HOST, free_port

__all__ = ["RedisNotInstalled", "RedisServer"]

INSTALL_HINT = ("redis-server is not installed: apt-get install redis-server (Debian/Ubuntu), "
                "brew install redis (macOS); `bash .ci/run` installs it")


class RedisNotInstalled(RuntimeError):
    """``redis-server`` (or ``openssl``, for TLS) is not on PATH (tests fail, never skip)."""


class RedisServer:
    """``with RedisServer() as r: r.url`` -- a fresh redis-server, stopped at exit.

    ``password`` alone: the default user's password (``requirepass``). With ``username``: an
    ACL user with that password and every right, and the default user switched off.
    """

    def __init__(self, *, password: str | None = None, username: str | None = None,
                 tls: bool = False, maxmemory: str | None = None,
                 policy: str = "allkeys-lru", unix_socket: bool = False) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisNotInstalled(INSTALL_HINT)
        if tls and shutil.which("openssl") is None:
            raise RedisNotInstalled("openssl is not installed: apt-get install openssl")
        if username and not password:
            raise ValueError("an ACL user needs a password")
        self.exe = exe
        self.password = password
        self.username = username
        self.tls = tls
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = 0
        self.dir = Path(tempfile.mkdtemp(prefix="kvplugin-redis-"))
        self.proc: subprocess.Popen | None = None
        self.socket = self.dir / "redis.sock" if unix_socket else None

    @property
    def ca_file(self) -> Path:
        """The CA certificate a client trusts to verify this server (``tls=True``)."""
        return self.dir / "ca.crt"

    @property
    def url(self) -> str:
        user = quote(self.username, safe="") if self.username else ""
        auth = f"{user}:{quote(self.password, safe='')}@" if self.password else ""
        if self.socket is not None:
            return f"unix://{auth}{self.socket}?db=0"
        if self.tls:
            return f"rediss://{auth}{HOST}:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://{auth}{HOST}:{self.port}/0"

    def _make_certificates(self) -> None:
        """A CA and a server certificate for 127.0.0.1 it signed (valid one day)."""
        d = self.dir

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
                "-out", "ca.crt", "-days", "1", "-subj", "/CN=kvplugin test CA")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
                "-out", "server.csr", "-subj", f"/CN={HOST}")
        (d / "san.cnf").write_text(f"subjectAltName=IP:{HOST}\n")
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.cnf")

    def _config(self) -> Path:
        lines = [f"bind {HOST}", 'save ""', "appendonly no", f"dir {self.dir}",
                 "protected-mode yes"]
        if self.tls:
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.dir}/server.crt",
                      f"tls-key-file {self.dir}/server.key",
                      f"tls-ca-cert-file {self.ca_file}", "tls-auth-clients no"]
        else:
            lines.append(f"port {self.port}")
        if self.username:
            lines += ["user default off", f"user {self.username} on >{self.password} ~* &* +@all"]
        elif self.password:
            lines.append(f"requirepass {self.password}")
        if self.socket is not None:
            lines += [f"unixsocket {self.socket}", "unixsocketperm 700"]
        if self.maxmemory:
            lines += [f"maxmemory {self.maxmemory}", f"maxmemory-policy {self.policy}"]
        path = self.dir / "redis.conf"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return path

    def start(self) -> RedisServer:
        """Start (or restart, on the same port) and wait until it answers PING."""
        self.port = self.port or free_port()
        if self.tls and not self.ca_file.exists():
            self._make_certificates()
        self.proc = subprocess.Popen([self.exe, str(self._config())], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
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

        tls = {"ssl": True, "ssl_ca_certs": str(self.ca_file)} if self.tls else {}
        return redis.Redis(host=HOST, port=self.port, username=self.username,
                           password=self.password, socket_timeout=5, **tls)

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
