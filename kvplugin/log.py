"""One-line user messages on stderr, each said once per process.

kvplugin runs inside someone else's server: it speaks rarely, prefixed ``kvplugin:``, and
never repeats itself (a warning per request would drown the host's own log).
Stdlib only: the bootstrap uses it.
"""

from __future__ import annotations

import logging
import sys
import threading

logger = logging.getLogger("kvplugin")
_said: set[str] = set()
_lock = threading.Lock()


def say(message: str, *, key: str | None = None) -> bool:
    """Print ``kvplugin: message`` to stderr unless the same key was said already."""
    key = key or message
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    print(f"kvplugin: {message}", file=sys.stderr, flush=True)
    logger.debug(message)
    return True


def forget() -> None:
    """Let every message be said again (tests)."""
    with _lock:
        _said.clear()
