"""One SSD tier directory: whether it can be used at all, and one budget over it, whatever
processes and models share it.

:func:`kvplugin.resources.usable_directory` answers the first before the server listens, by trying: a missing
directory must be creatable, an existing one listable; one that cannot be written (a
read-only mount, no write permission) is a read-only tier. Trying, not ``os.access``: root
passes ``access`` on ``/proc`` and on a directory it cannot list, and only a write tells a
read-only mount from a writable one everywhere.

The budget:

Why on disk: each process's index sees only the entries it wrote or found at start-up, so
budgets kept per process add up (two servers on one 4 MB directory ended at 7.5 MB) and a
process's LRU is blind to the others'. The disk is the one view every process shares, so
the budget is kept over what is *on disk*, under a cross-process lock:

* :func:`dir_lock`: ``fcntl.flock`` on ``<directory>/.kvplugin-lock`` (exclusive). Held by a
  writer from the moment its entry is published until the directory is within budget again,
  so two writers never both decide there is room. ``flock`` locks belong to the open file,
  so threads of one process exclude each other too.
* :func:`scan`: every entry file of every model subdirectory (ours by marker, not symlinks),
  with size and mtime (the tier refreshes an entry's mtime when it serves it, so mtime is the
  directory-wide LRU order), plus leftovers of writers: ``.tmp-<pid>-…``/``.claim-<pid>-…``.
* :func:`make_room`: removes leftovers whose writer is gone (pid not alive) or that are older
  than :data:`STALE_S`, then the least recently used entries of *any* model until the
  directory holds at most ``max_bytes`` (never the entry just written). LRU over everything
  is the only fair order: a process never keeps its entries at another's expense, and no
  process deletes another's entry while that one is more recent than its own oldest.

Symlinks are never followed: an entry-named link (or a link to a subdirectory) is skipped and
counted, never read or deleted through.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DirView", "LOCK_NAME", "STALE_S", "dir_lock", "leftover_name", "make_room", "scan"]

LOCK_NAME = ".kvplugin-lock"
STALE_S = 600.0  # a leftover whose writer pid is alive but older than this is abandoned
_LEFTOVER = re.compile(r"^\.(tmp|claim)-(?:(\d+)-)?[0-9a-f]+")


@contextlib.contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """Exclusive cross-process lock of ``directory`` (blocks until held)."""
    import fcntl

    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(Path(directory) / LOCK_NAME, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def leftover_name(kind: str, suffix: str) -> str:
    """A temp/claim file name that says which process made it (``kind``: tmp or claim)."""
    import uuid

    return f".{kind}-{os.getpid()}-{uuid.uuid4().hex}{suffix}"


@dataclass
class DirView:
    """What :func:`scan` found: entries as ``(mtime, size, path)``, leftovers as
    ``(mtime, size, path, pid or None)``, symlinks skipped."""

    entries: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)
    symlinks: int = 0

    @property
    def nbytes(self) -> int:
        return sum(e[1] for e in self.entries) + sum(t[1] for t in self.leftovers)


def scan(directory: Path, is_entry_name, is_ours) -> DirView:
    """Every entry file and leftover under ``directory``'s model subdirectories
    (``is_ours(path)``: a marked subdirectory of ours; ``is_entry_name(name)``)."""
    view = DirView()
    try:
        subs = list(os.scandir(directory))
    except OSError:
        return view
    for sub in subs:
        if sub.is_symlink():
            view.symlinks += 1
            continue
        if not sub.is_dir(follow_symlinks=False) or not is_ours(Path(sub.path)):
            continue
        try:
            names = list(os.scandir(sub.path))
        except OSError:
            continue
        for e in names:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            m = _LEFTOVER.match(e.name)
            if stat.S_ISLNK(st.st_mode):
                if m or is_entry_name(e.name):
                    view.symlinks += 1
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if m:
                pid = int(m.group(2)) if m.group(2) else None
                view.leftovers.append((st.st_mtime, st.st_size, Path(e.path), pid))
            elif is_entry_name(e.name):
                view.entries.append((st.st_mtime, st.st_size, Path(e.path)))
    return view


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True  # unknown writer: age decides
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, not ours to signal
    return True


def make_room(view: DirView, max_bytes: int, keep: Path | None = None,
              own_leftovers: frozenset = frozenset()) -> tuple[list[Path], list[Path], int]:
    """Delete abandoned leftovers, then LRU entries until ``view`` fits ``max_bytes``.

    Returns ``(entries removed, leftovers removed, bytes on disk after)``. ``own_leftovers``:
    this process's files in progress (never removed). Call under :func:`dir_lock`.
    """
    now = time.time()
    gone_tmp: list[Path] = []
    for mtime, size, path, pid in view.leftovers:
        if path in own_leftovers:
            continue
        if not _alive(pid) or now - mtime > STALE_S:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            gone_tmp.append(path)
    removed = set(gone_tmp)
    view.leftovers = [t for t in view.leftovers if t[2] not in removed]
    total = view.nbytes
    gone: list[Path] = []
    for mtime, size, path in sorted(view.entries, key=lambda e: (e[0], str(e[2]))):
        if total <= max_bytes:
            break
        if keep is not None and path == keep:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        total -= size
        gone.append(path)
    dropped = set(gone)
    view.entries = [e for e in view.entries if e[2] not in dropped]
    return gone, gone_tmp, total
