"""What the hot tier keeps of the entries it moved out to requests ("lent" snapshots).

An entry reused by a move is the requesting conversation's now, yet a concurrent request may
want the same prefix (stock deep-copies for both). So a move records a
:func:`~kvplugin.cache.layers.lend_view` of what it hands out: append-only layers themselves
(free to hold), every other layer as a snapshot. A later fetch of this thread may copy from it
(:meth:`Lent.best`); the insert that continues it settles it (:meth:`Lent.settle`).

Not thread-safe: :class:`~kvplugin.cache.store.prompt_store.PromptStore` calls it under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from kvplugin.cache.layers import can_copy_prefix, is_trimmable, lend_view
from kvplugin.types import StoreEntry

__all__ = ["MAX_LENT", "Lent"]

#: Snapshots held at once (requests in flight that may share a prefix); the oldest goes first.
MAX_LENT = 8


class Lent:
    """At most :data:`MAX_LENT` snapshots, oldest first, each with the thread that lent it."""

    def __init__(self) -> None:
        self._snaps: list[StoreEntry] = []
        self._thread: dict[int, int] = {}  # id(snapshot) -> the thread that lent it

    def __len__(self) -> int:
        return len(self._snaps)

    def lend(self, entry: StoreEntry, n: int, cache: list) -> None:
        """Record that ``entry`` (cut to ``n`` tokens) went to this thread as ``cache`` (its
        layers, or what the caller restored them to)."""
        self._snaps.append(StoreEntry(entry.model_key, entry.tokens[:n], lend_view(cache),
                                      entry.nbytes, entry.prompt_len, kind=entry.kind))
        self._thread[id(self._snaps[-1])] = threading.get_ident()
        del self._snaps[:-MAX_LENT]
        self._forget_dropped()

    def _forget_dropped(self) -> None:
        live = {id(s) for s in self._snaps}
        self._thread = {k: v for k, v in self._thread.items() if k in live}

    def best(self, model_key: Hashable, key: tuple) -> tuple[StoreEntry, int, bool] | None:
        """The snapshot holding most of ``key``: ``(snapshot, n, whole)``.

        Only what this thread lent: a lent layer may be the owner's live one, whose newest
        arrays MLX evaluates on the owner thread's stream (another thread gets "no Stream in
        current thread", or worse). Every host runs its model, fetches included, in one
        thread, so this costs nothing there."""
        best = None
        me = threading.get_ident()
        for snap in self._snaps:
            if snap.model_key != model_key or self._thread.get(id(snap)) != me:
                continue
            n = min(_common(snap.tokens, key), len(key) - 1)
            whole = n == len(snap.tokens)
            if n < 1 or not (whole or can_copy_prefix(snap.cache, n)):
                continue
            if best is None or n > best[1]:
                best = (snap, n, whole)
        return best

    def shared(self, model_key: Hashable, key: tuple) -> list[tuple[int, StoreEntry]]:
        """``(tokens shared with key, snapshot)`` of this thread's snapshots (see
        :meth:`best` on threads)."""
        me = threading.get_ident()
        return [(_common(snap.tokens, key), snap) for snap in self._snaps
                if snap.model_key == model_key and self._thread.get(id(snap)) == me]

    def settle(self, model_key: Hashable, key: tuple, cache: list) -> list[StoreEntry]:
        """At an insert of ``key`` holding ``cache``: drop the snapshots it continues. Returns
        those to store again: a shared prefix that the new entry cannot give by a copy (its
        continuation is recurrent state or a wrapped window) and that was no finished turn.
        (Stock keeps a finished turn's too: docs/store.md, *Contention*, says what that costs
        here.)"""
        keep, again = [], []
        for snap in self._snaps:
            n = len(snap.tokens)
            if snap.model_key != model_key or len(key) <= n or key[:n] != snap.tokens:
                keep.append(snap)
            elif snap.prompt_len is None and not (is_trimmable(cache)
                                                  and can_copy_prefix(cache, n)):
                again.append(snap)
        self._snaps = keep
        self._forget_dropped()
        return again

    def clear(self) -> None:
        self._snaps.clear()
        self._forget_dropped()


def _common(a: tuple, b: tuple) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
