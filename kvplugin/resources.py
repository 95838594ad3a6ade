"""What a setting names on this machine: a memory size, a directory, a Redis URL, tried
before serving.

Why a leaf below the settings: validating ``--max-memory`` and ``--ssd-cache-dir`` needs both,
and the settings must not reach up into the engine for them. Stdlib only.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

__all__ = ["TLS_FILE_OPTIONS", "check_redis_url", "check_tls_files", "masked_url", "parse_memory_limit",
           "physical_memory", "usable_directory"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# A write refused for these reasons leaves a directory that can still be read: read-only.
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# A full disk is the tier's to handle (it evicts, then counts failed spills), not an error.
_FULL = (errno.ENOSPC, errno.EDQUOT)


def physical_memory() -> int:
    """The machine's physical memory in bytes (what ``auto`` means)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_memory_limit(text: str) -> int | None:
    """``auto``, ``off``, ``12GiB``, ``800MB``, ``1e9`` (bytes), ``0.75`` or ``75%`` (of
    physical memory) -> bytes, ``None`` for ``off``. Raises ``ValueError`` saying why."""
    t = str(text).strip().lower()
    if t == "off":
        return None
    if t == "auto":
        return physical_memory()
    if t.endswith("%"):
        frac = float(t[:-1]) / 100 if re.fullmatch(r"[0-9]*\.?[0-9]+", t[:-1]) else -1.0
        if not 0 < frac <= 1:
            raise ValueError("a percentage must be in (0, 100]")
        return int(physical_memory() * frac)
    m = _SIZE.match(t)
    if m is None or m.group(2) not in _UNITS:
        raise ValueError("not a size")
    number, unit = float(m.group(1)), m.group(2)
    if not unit and number <= 1:
        if number <= 0:
            raise ValueError("must be > 0")
        return int(physical_memory() * number)  # a fraction of physical memory
    value = int(number * _UNITS[unit])
    if value < 2**20:
        raise ValueError("less than 1 MiB cannot hold a model")
    return value


def usable_directory(directory: Path) -> bool:
    """Whether the tier can write ``directory`` (True) or only read it (False, it exists and
    refuses writes); raises ``ValueError`` saying why it cannot use it at all (the caller
    names the path and the option). Every try is
    undone: nothing is left behind, a missing directory is not created."""
    import tempfile

    path = Path(directory)
    if not os.path.exists(path):  # (os.path: a parent that cannot be searched is "missing")
        if os.path.islink(path):
            raise ValueError("a symbolic link to nothing")
        parent = next(p for p in path.parents if os.path.exists(p))  # "/" or "." exists
        if not os.path.isdir(parent):
            raise ValueError(f"{parent} is not a directory")
        try:  # a name of our own: a directory another process creates now is never touched
            os.rmdir(tempfile.mkdtemp(prefix=f".kvplugin-probe-{os.getpid()}-", dir=parent))
        except OSError as e:
            raise ValueError(f"cannot be created: {e.strerror} in {parent}") from None
        return True
    if not os.path.isdir(path):
        raise ValueError("not a directory")
    try:
        os.listdir(path)
        os.stat(os.path.join(path, "."))  # entries are reached through it: search permission too
    except OSError as e:
        raise ValueError(f"cannot be read: {e.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=f".kvplugin-probe-{os.getpid()}-", dir=path)
    except OSError as e:
        if e.errno in _READ_ONLY:
            return False
        if e.errno in _FULL:
            return True
        raise ValueError(f"cannot be written: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)
    return True


#: Query parameters of a ``rediss://`` URL that name files the redis client reads.
TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")


def check_redis_url(url: str) -> str:
    """The shape of a ``--kv-cache-remote`` URL (stripped), or ``ValueError`` saying what is
    wrong; reachability is the tier's business (a Redis that is down is served around)."""
    from urllib.parse import urlsplit

    text = url.strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as e:
        raise ValueError(f"not a URL ({e})") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("the scheme must be redis://, rediss:// or unix://")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError("unix:// needs the socket's path")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("no host")
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ValueError(f"the database {db!r} is not a number")
    check_tls_files(parts.scheme, parts.query)
    return text


def check_tls_files(scheme: str, query: str) -> None:
    """TLS options only on ``rediss://``, and the files they name readable now: a missing CA
    would otherwise surface at the first connection, as a Redis that is down."""
    from urllib.parse import parse_qsl

    for name, value in parse_qsl(query, keep_blank_values=True):
        if not name.startswith("ssl_"):
            continue
        if scheme != "rediss":
            raise ValueError(f"{name} is a TLS option: use rediss://")
        if name in TLS_FILE_OPTIONS and not os.access(value, os.R_OK):
            raise ValueError(f"{name}={value} cannot be read")


def masked_url(url: str) -> str:
    """``url`` without its passwords (the one before the host, and any query parameter
    named ``*password*``, which the redis client also takes): for messages, stats, logs and
    ``kvplugin info``."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        netloc, query = parts.netloc, parts.query
        if parts.password is not None:
            host = netloc.rpartition("@")[2]  # as written ([::1]:6379 keeps its brackets)
            netloc = (f"{parts.username}:***@" if parts.username else ":***@") + host
        pairs = parse_qsl(query, keep_blank_values=True)
        if any("password" in name.lower() for name, _ in pairs):
            query = urlencode([(n, "***" if "password" in n.lower() else v) for n, v in pairs],
                              safe="/*")
    except ValueError:
        return "<a URL>"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
