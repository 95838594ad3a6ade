"""Entries held in memory only while no other request runs, for a host whose stock holds none.

Why: mlx-openai-server's own prompt cache keeps every entry in a file, so any entry kvplugin
held in memory beside a running request would raise the process's peak above stock's. Held
only between requests, the next turn of the conversation that just ended is a move (no file
written or read, no codec), and a request that does not take it finds it written out before
its prefill allocates anything. An entry finished while other requests run goes straight to
the files.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

__all__ = ["IdleHold"]


class IdleHold:
    """The requests in flight, and what that allows the store to keep in memory."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._live: set[Hashable] = set()
        self._lock = threading.Lock()

    def started(self, key: Hashable) -> None:
        with self._lock:
            self._live.add(key)

    def done(self, key: Hashable) -> None:
        with self._lock:
            self._live.discard(key)

    def may_hold(self) -> bool:
        """Can a finished entry stay in memory? Only if no request but its own still runs."""
        with self._lock:
            return len(self._live) <= 1

    def fetched(self) -> None:
        """A request took what it reuses (or nothing): every other entry goes to the files."""
        self.store.flush()
