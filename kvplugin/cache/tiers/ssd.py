"""``SSDTier``: the built-in cold tier (:class:`kvplugin.types.ColdTier`), files on a local disk.

Layout and format
-----------------
``<directory>/<slug>-<sha256(model_key)[:16]>/<sha256(tokens)[:40]>.safetensors``

* ``directory`` is created 0o700 if missing (an existing one is left as is); every
  per-model subdirectory is created 0o700 and must be owned by us, marked, not a symlink
  (otherwise the tier refuses to use it); the modes of existing directories are the
  operator's and never set back.  Entry files are created 0o600.  No symlink is followed:
  files are opened ``O_NOFOLLOW`` and scanned with ``lstat``; an entry-named link is
  skipped and counted (``symlinks``).
* A directory the process cannot write (a read-only mount) is a read-only tier: its
  entries are served (an entry that cannot be claimed is read in place and stays indexed),
  nothing is spilled.
* The model fingerprint is ``str(model_key)`` hashed into the subdirectory name
  (``slug`` is a sanitised readable tail), and is also stored in every file and
  checked on load, so two models never share entries.
* One safetensors file per entry: see :mod:`kvplugin.cache.tiers.ssd_file`.

Writes are atomic: a ``.tmp-<pid>-*`` file created 0o600 in the same directory, written,
``fsync``-ed, ``os.replace``-d over the final name, then the directory is fsync-ed.
A failed write leaves no temp file; a killed writer's is removed by the next writer of any
process (its pid is dead, or it is older than ``ssd_dir.STALE_S``).  A full disk
(ENOSPC/EDQUOT) evicts LRU entries to make room and retries once; failures are counted
(``write_failures``) and said at most once a minute.

Index and restart
-----------------
The index lives in memory: per model a radix trie over token tuples, plus one LRU
order by access time.  A new ``SSDTier`` on the same directory rebuilds it by
reading only each file's safetensors header and its ``__tokens__`` bytes; the LRU
order comes from file mtimes (which a hit refreshes).  Files that fail validation
(bad header, size not matching the header, wrong model, token hash not matching the
name, unknown format) are removed.

Budget (:mod:`kvplugin.cache.tiers.ssd_dir`): ``max_bytes`` over everything on disk in the
directory, whatever processes and models share it. After a put, under a cross-process
``flock``, dead writers' leftovers and then the least recently used entry files of any
model (by mtime, which a hit refreshes) are deleted until the directory fits (never the
file just written; an entry larger than ``max_bytes`` is refused). An entry another
process removed is a plain miss here (the index follows the disk).  A trimmable entry
supersedes (deletes) stored entries whose tokens are a strict prefix of its own.

Fetch (same choice rule as the hot tier, ``index.choose``)
----------------------------------------------------------
* Longest stored prefix of the request (an exact match only if trimmable; then
  ``n = len(tokens)`` and the store trims one token): the file is **consumed**
  (claimed by rename, loaded, evaluated, deleted) and the cache handed over: the
  entry is promoted to the caller, who re-inserts it hot after generation.
* Else a longer/diverging entry sharing ``c`` tokens, if trimmable: the file is
  **kept** (it is another conversation's) and touched; the caller gets a fresh copy
  of the first ``min(c, len(tokens))`` positions.
* A file that cannot be read or validated is a miss and is removed; never raises.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvplugin.cache.store.index import KeyIndex, to_key
from kvplugin.cache.layers import can_copy_prefix, copy_prefix
from kvplugin.cache.tiers.serialize import Corrupt, Unsupported, deserialize_cache, serialize_cache
from kvplugin.cache.tiers.refusals import Refusals
from kvplugin.cache.tiers.ssd_dir import DirView, dir_lock, leftover_name, make_room, scan
from kvplugin.cache.tiers.ssd_file import (ENTRY_NAME as _ENTRY_NAME, FORMAT, SUFFIX, TOKENS,
                                           fsync_dir as _fsync_dir, is_regular as _is_regular,
                                           key_name as _key_name, model_dir_name,
                                           read_header as _read_header, tensor_digest,
                                           unlink as _unlink)

__all__ = ["SSDTier"]

log = logging.getLogger("kvplugin.cache")

# A model subdirectory is ours only if it carries this marker: the root may be a folder
# the user also keeps other things in (even model weights), which we must never touch.
MARKER = ".kvplugin-tier"
_FAILURE_LOG_S = 60.0


# ------------------------------------------------------------------ the tier


@dataclass
class _Rec:
    model_dir: str
    key: tuple
    size: int
    trimmable: bool


class SSDTier:
    """Safetensors-on-disk cold tier (see the module docstring).

    ``directory``: root folder (created 0o700 if missing).  ``max_bytes``: budget
    over the files' sizes.  Thread-safe (one internal lock for the index; file
    reads and writes happen outside it).
    """

    def __init__(self, directory: Path | str, max_bytes: int):
        self.directory = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)
        self._lock = threading.RLock()
        self._index = KeyIndex(size=lambda r: r.size)  # (model_dir, tokens) -> _Rec
        self._closed = False
        self.counters = dict.fromkeys(
            "puts refused hits copies misses evictions superseded corrupt unreadable "
            "write_failures leftovers_removed".split(), 0
        )
        self._by_file: dict[tuple[str, str], _Rec] = {}  # (model_dir, file name) -> record
        self._copies: dict[int, _Rec] = {}  # id of a recent prefix copy -> its source
        self._writing: set[Path] = set()  # our temp files in progress (never cleaned)
        self._disk_bytes: int | None = None  # the whole directory at the last scan
        self._symlinks = 0  # entry-named symlinks (and links in place of subdirectories) seen
        self._last_failure_log = float("-inf")
        self._refusals = Refusals(f"cold tier {self.directory}")
        if not self.directory.exists():
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.read_only = not os.access(self.directory, os.W_OK | os.X_OK)
        if self.read_only:
            from kvplugin.log import say

            say(f"cold tier {self.directory} is read-only: its entries are served, nothing "
                "is spilled to it", key=f"ssd-read-only:{self.directory}")
        self._rebuild()

    # ---------------------------------------------------------------- info

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def nbytes(self) -> int:
        """Total size of the indexed files."""
        with self._lock:
            return self._index.nbytes

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def _refuse(self, reason: str, say: str | None = None) -> None:
        """An entry not written: ``refused``, and by reason (said once with ``say``)."""
        self._count("refused")
        self._refusals.count(reason, say)

    def _over_budget(self, size: int) -> str:
        return (f"stores no entry larger than its budget ({size} > {self.max_bytes} bytes, "
                "--ssd-cache-max-gb); such entries are dropped when evicted")

    def stats(self) -> dict:
        """Counters: entries, bytes (this process's index), disk_bytes (the whole directory,
        every process and model, at the last scan), puts, refused, hits (files consumed),
        copies (prefix copies), misses, evictions (any process's entries this one removed for
        the shared budget), superseded, corrupt (files removed), unreadable (I/O errors on
        read), write_failures, leftovers_removed (dead writers' temp files), symlinks;
        refused_by_reason (see :mod:`kvplugin.cache.tiers.refusals`)."""
        with self._lock:
            return {"entries": len(self._index), "bytes": self._index.nbytes,
                    "disk_bytes": self._disk_bytes, "symlinks": self._symlinks,
                    **self.counters, "refused_by_reason": self._refusals.by_reason()}

    def close(self) -> None:
        """Stop using the directory (files stay for the next process)."""
        with self._lock:
            self._closed = True
            self._index.clear()

    # ---------------------------------------------------------------- paths

    model_dir_name = staticmethod(model_dir_name)

    def _secure_dir(self, path: Path, create: bool) -> bool:
        """Is ``path`` one of our model directories (marked, ours, 0o700)? Make it if asked."""
        try:
            if create:
                try:
                    os.mkdir(path, 0o700)
                    (path / MARKER).touch(mode=0o600)
                except FileExistsError:
                    pass
            st = os.lstat(path)
        except OSError:
            return False
        if (
            not stat.S_ISDIR(st.st_mode)
            or st.st_uid != os.getuid()
            or not _is_regular(path / MARKER)
        ):
            if create:
                log.warning("kvplugin: refusing cache directory %s (not our directory)", path)
            return False
        return True  # its mode is the operator's (made 0o700; never chmod-ed back)

    # ---------------------------------------------------------------- index

    def _index_add(self, rec: _Rec) -> None:
        """Under the lock."""
        self._index.add(rec.model_dir, rec.key, rec)
        self._by_file[(rec.model_dir, _key_name(rec.key))] = rec

    def _index_remove(self, rec: _Rec) -> None:
        """Under the lock (does not touch the file)."""
        self._index.remove(rec.model_dir, rec.key)
        self._by_file.pop((rec.model_dir, _key_name(rec.key)), None)

    def _drop(self, rec: _Rec) -> None:
        """Under the lock: remove from the index and delete the file."""
        self._index_remove(rec)
        _unlink(self.directory / rec.model_dir / _key_name(rec.key))

    def _is_ours(self, sub: Path) -> bool:
        return sub.name[:1].isalnum() and self._secure_dir(sub, create=False)

    def _scan(self) -> DirView:
        view = scan(self.directory, lambda n: bool(_ENTRY_NAME.match(n)), self._is_ours)
        self._symlinks = view.symlinks
        return view

    def _rebuild(self) -> None:
        found = []
        view = self._scan()
        for _, _, p in view.entries:
            try:
                _, meta = _read_header(p)
                key = meta["__key__"]
                if (self.model_dir_name(meta.get("model_key")) != p.parent.name
                        or _key_name(key) != p.name):
                    raise Corrupt("misplaced file")
                st = os.lstat(p)
            except FileNotFoundError:
                continue  # another process took it meanwhile
            except (OSError, Corrupt, ValueError, KeyError, TypeError) as e:
                log.warning("kvplugin: removing unreadable cache file %s: %s", p, e)
                self.counters["corrupt"] += 1
                _unlink(p)
                continue
            rec = _Rec(p.parent.name, key, st.st_size, meta.get("trimmable") == "1")
            found.append((st.st_mtime, p.name, rec))
        found.sort(key=lambda t: t[0])
        with self._lock:
            for _, name, rec in found:
                self._index_add(rec)
            self._enforce(keep=None)

    def _enforce(self, keep: Path | None, free: int = 0) -> None:
        """Under the lock: the whole directory (every process, every model) back within
        ``max_bytes - free``: dead writers' leftovers, then LRU entries (see ``ssd_dir``)."""
        if self.read_only:
            self._disk_bytes = self._scan().nbytes
            return
        try:
            with dir_lock(self.directory):
                view = self._scan()
                target = max(0, min(self.max_bytes, view.nbytes) - free) if free else self.max_bytes
                gone, gone_tmp, total = make_room(view, target, keep, frozenset(self._writing))
        except OSError as e:
            log.debug("kvplugin: cold tier budget not enforced: %s", e)
            return
        self._disk_bytes = total
        self.counters["leftovers_removed"] += len(gone_tmp)
        for path in gone:
            self.counters["evictions"] += 1
            rec = self._by_file.get((path.parent.name, path.name))
            if rec is not None:
                self._index_remove(rec)

    # ---------------------------------------------------------------- put

    def put(self, model_key: str, tokens: Sequence[int], cache: list) -> bool:
        """Write ``cache`` (atomically).  False if refused (closed, unsupported layer
        kind, larger than ``max_bytes``, I/O error)."""
        key = to_key(tokens)
        if self._closed or not key or not cache:
            return False
        if self.read_only:
            self._refuse("read_only")  # said when the tier started
            return False
        try:
            arrays, layers = serialize_cache(cache)
        except Unsupported as e:
            self._count("refused")
            self._refusals.unsupported(e, "stores")
            return False
        if (size := sum(a.nbytes for a in arrays.values())) > self.max_bytes:
            self._refuse("over_budget", self._over_budget(size))
            return False
        trimmable = can_copy_prefix(cache, len(key))
        arrays[TOKENS] = mx.array(key, dtype=mx.int64)
        mx.eval(list(arrays.values()))
        meta = {
            "format": FORMAT,
            "digest": tensor_digest(arrays),
            "model_key": str(model_key),
            "n_tokens": str(len(key)),
            "trimmable": "1" if trimmable else "0",
            "layers": json.dumps(layers, separators=(",", ":")),
        }
        mdir_name = self.model_dir_name(model_key)
        mdir = self.directory / mdir_name
        name = _key_name(key)
        if not self._secure_dir(mdir, create=True):
            self._refuse("not_our_directory")  # said by _secure_dir
            return False
        need = sum(a.nbytes for a in arrays.values()) + (1 << 16)  # + header, roughly
        tmp = mdir / leftover_name("tmp", SUFFIX)
        with self._lock:
            self._writing.add(tmp)
        try:
            try:
                size = self._write(tmp, arrays, meta)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # A full disk: make room (LRU over the directory), then try once more.
                with self._lock:
                    self._enforce(keep=None, free=need)
                size = self._write(tmp, arrays, meta)
            del arrays
            with self._lock:
                if size > self.max_bytes or self._closed:  # refused, not a failed write
                    _unlink(tmp)
                    self.counters["refused"] += 1
                    if size > self.max_bytes:
                        self._refusals.count("over_budget", self._over_budget(size))
                    else:
                        self._refusals.count("closed")
                    return False
                os.replace(tmp, mdir / name)
                self._writing.discard(tmp)
                _fsync_dir(mdir)
                rec = _Rec(mdir_name, key, size, trimmable)
                self._index_add(rec)
                if trimmable:
                    for _, prev in self._index.prefixes_of(mdir_name, key):
                        self._drop(prev)
                        self.counters["superseded"] += 1
                self._enforce(keep=mdir / name)
                self.counters["puts"] += 1
            return True
        except Exception as e:
            _unlink(tmp)
            self._write_failed(e)
            return False
        finally:
            with self._lock:
                self._writing.discard(tmp)

    @staticmethod
    def _write(tmp: Path, arrays: dict, meta: dict) -> int:
        """Write and fsync ``tmp`` (new, 0o600, not through a symlink); its size."""
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NOFOLLOW", 0))
        try:
            fd = os.open(tmp, flags, 0o600)
            with os.fdopen(fd, "wb") as f:
                mx.save_safetensors(f, arrays, meta)
                f.flush()
                os.fsync(f.fileno())
            return os.stat(tmp).st_size
        except BaseException:
            _unlink(tmp)
            raise

    def _write_failed(self, e: Exception) -> None:
        """Count a failed spill; say so at most once a minute (a full disk fails every one)."""
        now = time.monotonic()
        self._refusals.count("write_failed")  # said below, at most once a minute
        with self._lock:
            self.counters["refused"] += 1
            self.counters["write_failures"] += 1
            n = self.counters["write_failures"]
            loud = now - self._last_failure_log >= _FAILURE_LOG_S
            if loud:
                self._last_failure_log = now
        if loud:
            log.warning("kvplugin: cold tier write failed: %s (%d write failure(s) so far; "
                        "said at most once a minute)", e, n)
        else:
            log.debug("kvplugin: cold tier write failed: %s", e)

    # ---------------------------------------------------------------- fetch

    def _plan(self, model_key, key):
        return self._index.choose(self.model_dir_name(model_key), key,
                                  trimmable=lambda r: r.trimmable,
                                  copyable=lambda r, n: r.trimmable)

    def probe(self, model_key: str, tokens: Sequence[int]) -> int:
        """Tokens ``fetch`` would cover now (index only, no I/O; 0 if none)."""
        key = tokens if isinstance(tokens, tuple) else to_key(tokens)
        with self._lock:
            plan = self._plan(model_key, key)
        if plan is None:
            return 0
        mode, rec, n = plan
        return len(rec.key) if mode == "move" else n

    def discard(self, cache: list) -> None:
        """The caller refused ``cache``, a prefix copy this tier just returned (it does not
        fit the model): its file is deleted so it is not read again. (A consumed entry's
        file is gone already.)"""
        with self._lock:
            rec = self._copies.pop(id(cache), None)
            if rec is not None and self._index.get(rec.model_dir, rec.key) is rec:
                self._drop(rec)

    def fetch(self, model_key: str, tokens: Sequence[int]) -> tuple[list, int] | None:
        """See the module docstring: ``(cache, n)`` or None; never raises."""
        key = to_key(tokens)
        with self._lock:
            if self._closed:
                return None
            plan = self._plan(model_key, key)
            if plan is None:
                self.counters["misses"] += 1
                return None
            mode, rec, n = plan
            path = self.directory / rec.model_dir / _key_name(rec.key)
            if mode == "move":  # claim the file so a concurrent put can't be deleted
                claim = path.with_name(leftover_name("claim", SUFFIX))
                try:
                    os.replace(path, claim)
                    self._index_remove(rec)
                    path, n = claim, len(rec.key)
                except FileNotFoundError:  # gone behind our back: the index follows the disk
                    self._index_remove(rec)
                    self.counters["misses"] += 1
                    return None
                except OSError:
                    # Read-only tier (EROFS, EACCES on the directory): the entry cannot be
                    # claimed but can still be read; it stays indexed and on disk.
                    mode, n = "read", len(rec.key)
                    self._index.touch(rec.model_dir, rec.key)
            else:
                self._index.touch(rec.model_dir, rec.key)
                try:
                    os.utime(path, follow_symlinks=False)  # the directory-wide LRU order
                except OSError:
                    pass
        try:
            cache = self._load(path, model_key, rec.key)
        except Exception as e:  # corrupted / truncated / vanished: a miss, file removed
            gone = isinstance(e, FileNotFoundError)  # another process evicted it: a miss
            if not gone:
                log.warning("kvplugin: dropping unreadable cache file %s: %s", path, e)
            with self._lock:
                if not gone:
                    self.counters["unreadable" if isinstance(e, OSError) else "corrupt"] += 1
                self.counters["misses"] += 1
                if mode != "move" and self._index.get(rec.model_dir, rec.key) is rec:
                    self._drop(rec)
            if mode == "move":
                _unlink(path)
            return None
        if mode in ("move", "read"):
            if mode == "move":
                _unlink(path)
            with self._lock:
                self._copies.pop(id(cache), None)  # an id reused: never a stale source
                self.counters["hits"] += 1
            return cache, n
        out = copy_prefix(cache, n)
        del cache
        with self._lock:
            self.counters["copies" if out is not None else "misses"] += 1
            if out is not None:  # which file it came from, for ``discard`` (a few recent;
                # by id only, never keeping the caller's cache alive)
                if len(self._copies) >= 16:
                    self._copies.pop(next(iter(self._copies)))
                self._copies[id(out)] = rec
        return (out, n) if out is not None else None

    def _load(self, path: Path, model_key, key: tuple) -> list:
        _, meta = _read_header(path)
        if meta["__key__"] != key or meta.get("model_key") != str(model_key):
            raise Corrupt("file does not hold this entry")
        layers = json.loads(meta["layers"])
        arrays = mx.load(str(path))
        if tensor_digest(arrays) != meta.get("digest"):
            raise Corrupt("tensor data does not match the file's digest")
        arrays.pop(TOKENS, None)
        cache = deserialize_cache(arrays, layers)
        mx.eval(list(arrays.values()))  # read everything now (the file may go away)
        return cache
