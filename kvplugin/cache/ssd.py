"""``SSDTier``: the built-in cold tier of :class:`kvplugin.cache.store.PromptStore`.

Layout and format
-----------------
``<directory>/<slug>-<sha256(model_key)[:16]>/<sha256(tokens)[:40]>.safetensors``

* ``directory`` is created 0o700 if missing (an existing one is left as is); every
  per-model subdirectory is ours and kept 0o700, owned by us, not a symlink
  (otherwise the tier refuses to use it).  Entry files are 0o600.
* The model fingerprint is ``str(model_key)`` hashed into the subdirectory name
  (``slug`` is a sanitised readable tail), and is also stored in every file and
  checked on load, so two models never share entries.
* One safetensors file per entry, written with ``mx.save_safetensors`` (no pickle;
  all mlx dtypes incl. bf16/fp16 and packed uint32 round-trip).  Tensors:
  ``__tokens__`` (int64, the entry's token key) and the layers' arrays, named
  ``l<i>.<field>[.<j>]`` (``CacheList`` children ``l<i>.c<j>.``).  String metadata:
  ``format`` (``kvplugin.cache/1``), ``model_key``, ``n_tokens``, ``trimmable``
  (``"1"`` if a prefix of the entry can be copied, see ``store.can_copy_prefix``)
  and ``layers``: JSON, one descriptor per layer: ``kind`` (mlx-lm base class used
  for the layout), ``cls`` (``module:qualname`` of the real class), ``attrs``
  (scalars: offset, step, max_size, keep, _idx, bits, group_size, chunk_size,
  start_position and any scalar instance attribute of a subclass), ``arrays``.
* Only the used positions are written (``keys[..., :offset, :]``; a rotating cache
  that has wrapped is written whole with its ``_idx``).  Quantized layers stay
  quantized (packed + scales + biases) on disk and after reload.
* Supported layer kinds: ``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache``,
  ``ChunkedKVCache``, ``ConcatenateKVCache``, ``ArraysCache``, ``CacheList`` and
  their subclasses whose extra instance attributes are plain scalars.  ``put`` of
  anything else returns False.  On load the real class is used if its module is
  already imported (nothing is imported from file data) and it subclasses the
  recorded kind; otherwise the kind's mlx-lm class.

Writes are atomic: a ``.tmp-*`` file created 0o600 in the same directory, written,
``fsync``-ed, ``os.replace``-d over the final name, then the directory is fsync-ed.
A failed write leaves no temp file.

Index and restart
-----------------
The index lives in memory: per model a radix trie over token tuples, plus one LRU
order by access time.  A new ``SSDTier`` on the same directory rebuilds it by
reading only each file's safetensors header and its ``__tokens__`` bytes; the LRU
order comes from file mtimes (which a hit refreshes).  Files that fail validation
(bad header, size not matching the header, wrong model, token hash not matching the
name, unknown format) are removed.  ``.tmp-*``/``.claim-*`` leftovers older than a
minute are removed.  One process should own a directory at a time.

Budget: ``max_bytes`` over the files' sizes; after a put, least recently used files
are deleted until the total fits (never the file just written; an entry larger
than ``max_bytes`` is refused).  A trimmable entry supersedes (deletes) stored
entries whose tokens are a strict prefix of its own.

Fetch (same choice rule as the hot tier, ``store.choose``)
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

import hashlib
import json
import logging
import os
import re
import stat
import struct
import sys
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models import cache as _mlc

from .store import (
    KNOWN_FIELDS,
    PrefixTrie,
    _kind_of,
    can_copy_prefix,
    choose,
    copy_prefix,
    extra_scalars,
    to_key,
)

__all__ = ["SSDTier", "serialize_cache", "deserialize_cache"]

log = logging.getLogger("kvplugin.cache")

FORMAT = "kvplugin.cache/1"
TOKENS = "__tokens__"
SUFFIX = ".safetensors"
# A model subdirectory is ours only if it carries this marker: the root may be a folder
# the user also keeps other things in (even model weights), which we must never touch.
MARKER = ".kvplugin-tier"
_ENTRY_NAME = re.compile(r"^[0-9a-f]{40}" + re.escape(SUFFIX) + "$")
_MAX_HEADER = 256 << 20
_STALE_S = 60.0


_SCALAR_TYPES = (int, float, bool, str, type(None))


class _Unsupported(Exception):
    pass


class _Corrupt(Exception):
    pass


# ------------------------------------------------------------------ serialisation


def _cls_spec(obj) -> str:
    t = type(obj)
    return f"{t.__module__}:{t.__qualname__}"


def _resolve(spec: str, kind: str):
    base = getattr(_mlc, kind, None)
    if base is None:
        raise _Corrupt(f"unknown layer kind {kind!r}")
    module, _, qual = spec.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if obj is None:  # e.g. a class registered into mlx_lm.models.cache by name
        obj = getattr(_mlc, qual, None) if "." not in qual else None
    if isinstance(obj, type) and issubclass(obj, base):
        return obj
    return base


def _slice(x, n: int):
    return x if x.shape[-2] == n else x[..., :n, :]


def _put_arrays(arrays: dict, name: str, value, n: int | None):
    """Register array(s) ``value`` (cut to n positions if n is not None) -> descriptor."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        names = []
        for j, a in enumerate(value):
            if not isinstance(a, mx.array):
                raise _Unsupported(f"{name}[{j}] is not an array")
            arrays[f"{name}.{j}"] = a if n is None else _slice(a, n)
            names.append(f"{name}.{j}")
        return {"seq": "tuple" if isinstance(value, tuple) else "list", "names": names}
    if not isinstance(value, mx.array):
        raise _Unsupported(f"{name} is not an array")
    arrays[name] = value if n is None else _slice(value, n)
    return name


def _ser_layer(layer, prefix: str, arrays: dict) -> dict:
    kind = _kind_of(layer)
    if kind is None:
        raise _Unsupported(type(layer).__name__)
    attrs = extra_scalars(layer, kind)
    if attrs is None:
        raise _Unsupported(f"{type(layer).__name__} has non-scalar attributes")
    desc: dict = {"kind": kind, "cls": _cls_spec(layer), "attrs": attrs, "arrays": {}}
    if kind == "CacheList":
        desc["children"] = [_ser_layer(c, f"{prefix}c{j}.", arrays) for j, c in enumerate(layer.caches)]
        desc["tuple"] = isinstance(layer.caches, tuple)
        return desc
    if kind == "ArraysCache":
        cache = layer.cache
        desc["arrays"]["cache"] = [
            _put_arrays(arrays, f"{prefix}cache.{j}", a, None) for j, a in enumerate(cache)
        ]
        for f in ("left_padding", "lengths"):
            desc["arrays"][f] = _put_arrays(arrays, f"{prefix}{f}", getattr(layer, f, None), None)
        return desc
    for f in KNOWN_FIELDS[kind]:
        if f not in ("keys", "values"):
            v = getattr(layer, f)
            if not isinstance(v, _SCALAR_TYPES):
                raise _Unsupported(f"{kind}.{f} is not a scalar")
            attrs[f] = v
    offset = layer.offset
    n: int | None = offset
    if kind == "ChunkedKVCache":
        n = offset - layer.start_position
    elif kind == "RotatingKVCache":
        if not (offset < layer.max_size and layer._idx == offset):
            n = None  # wrapped or concat layout: keep the whole buffer and _idx
    for f in ("keys", "values"):
        desc["arrays"][f] = _put_arrays(arrays, f"{prefix}{f}", getattr(layer, f), n)
    return desc


def serialize_cache(cache: list) -> tuple[dict, list]:
    """cache -> (arrays by name, layer descriptors).  Raises ``_Unsupported``."""
    arrays: dict = {}
    layers = [_ser_layer(c, f"l{i}.", arrays) for i, c in enumerate(cache)]
    return arrays, layers


def _get_arrays(arrays: dict, d):
    if d is None:
        return None
    if isinstance(d, str):
        return arrays[d]
    seq = [arrays[n] for n in d["names"]]
    return tuple(seq) if d["seq"] == "tuple" else seq


def _de_layer(desc: dict, arrays: dict):
    kind = desc["kind"]
    cls = _resolve(desc["cls"], kind)
    obj = cls.__new__(cls)
    for k, v in desc["attrs"].items():
        setattr(obj, k, v)
    if kind == "CacheList":
        kids = [_de_layer(c, arrays) for c in desc["children"]]
        obj.caches = tuple(kids) if desc.get("tuple") else kids
        return obj
    a = desc["arrays"]
    if kind == "ArraysCache":
        obj.cache = [_get_arrays(arrays, d) for d in a["cache"]]
        obj.left_padding = _get_arrays(arrays, a.get("left_padding"))
        obj.lengths = _get_arrays(arrays, a.get("lengths"))
        return obj
    obj.keys = _get_arrays(arrays, a["keys"])
    obj.values = _get_arrays(arrays, a["values"])
    if not isinstance(obj.offset, int) or obj.offset < 0:
        raise _Corrupt("bad offset")
    if obj.keys is not None:
        first = obj.keys[0] if isinstance(obj.keys, (list, tuple)) else obj.keys
        need = obj.offset - getattr(obj, "start_position", 0)
        if kind == "RotatingKVCache":
            need = min(need, obj.max_size)
        if first.shape[-2] < need:
            raise _Corrupt("arrays shorter than offset")
    return obj


def deserialize_cache(arrays: dict, layers: list) -> list:
    """Inverse of :func:`serialize_cache` (arrays as loaded by ``mx.load``)."""
    try:
        return [_de_layer(d, arrays) for d in layers]
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        raise _Corrupt(f"bad layer data: {e}") from e


# ------------------------------------------------------------------ file helpers


def _key_name(key: tuple) -> str:
    return hashlib.sha256(_tokens_bytes(key)).hexdigest()[:40] + SUFFIX


def _tokens_bytes(key: tuple) -> bytes:
    a = array("q", key)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def _read_header(path: Path) -> tuple[dict, dict]:
    """Parse and validate a safetensors header.  Returns (tensors, metadata).
    Also reads the ``__tokens__`` tensor, returned as metadata["__key__"]."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise _Corrupt("short file")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > min(size - 8, _MAX_HEADER):
            raise _Corrupt("bad header length")
        try:
            header = json.loads(f.read(hlen))
        except ValueError as e:
            raise _Corrupt("bad header json") from e
        if not isinstance(header, dict):
            raise _Corrupt("bad header")
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise _Corrupt("not a kvplugin cache file")
        end = 0
        for t in header.values():
            lo, hi = t["data_offsets"]
            if not 0 <= lo <= hi:
                raise _Corrupt("bad offsets")
            end = max(end, hi)
        if 8 + hlen + end != size:
            raise _Corrupt(f"size {size} != {8 + hlen + end} (truncated?)")
        tok = header.get(TOKENS)
        if not tok or tok.get("dtype") != "I64":
            raise _Corrupt("no token key")
        lo, hi = tok["data_offsets"]
        n = int(meta.get("n_tokens", -1))
        if hi - lo != 8 * n or tok.get("shape") != [n] or n < 1:
            raise _Corrupt("token key size mismatch")
        f.seek(8 + hlen + lo)
        buf = f.read(hi - lo)
    a = array("q")
    a.frombytes(buf)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    meta["__key__"] = tuple(a)
    return header, meta


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
        self._tries: dict[str, PrefixTrie] = {}
        self._lru: OrderedDict = OrderedDict()  # (model_dir, name) -> _Rec
        self._nbytes = 0
        self._closed = False
        self.counters = dict.fromkeys(
            "puts refused hits copies misses evictions superseded corrupt".split(), 0
        )
        if not self.directory.exists():
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)
        self._rebuild()

    # ---------------------------------------------------------------- info

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def nbytes(self) -> int:
        """Total size of the indexed files."""
        with self._lock:
            return self._nbytes

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def stats(self) -> dict:
        """Counters: entries, bytes, puts, refused, hits (files consumed), copies
        (prefix copies), misses, evictions, superseded, corrupt (files removed)."""
        with self._lock:
            return {"entries": len(self._lru), "bytes": self._nbytes, **self.counters}

    def close(self) -> None:
        """Stop using the directory (files stay for the next process)."""
        with self._lock:
            self._closed = True
            self._tries.clear()
            self._lru.clear()
            self._nbytes = 0

    # ---------------------------------------------------------------- paths

    @staticmethod
    def model_dir_name(model_key: Any) -> str:
        s = str(model_key)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", s)[-48:].lstrip("._-") or "model"
        return f"{slug}-{hashlib.sha256(s.encode()).hexdigest()[:16]}"

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
            or not (path / MARKER).is_file()
        ):
            if create:
                log.warning("kvplugin: refusing cache directory %s (not our directory)", path)
            return False
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)
        return True

    # ---------------------------------------------------------------- index

    def _index_add(self, rec: _Rec, name: str) -> None:
        """Under the lock."""
        trie = self._tries.setdefault(rec.model_dir, PrefixTrie())
        old = trie.insert(rec.key, rec)
        if old is not None:
            self._nbytes -= old.size
            self._lru.pop((old.model_dir, name), None)
        self._lru[(rec.model_dir, name)] = rec
        self._nbytes += rec.size

    def _index_remove(self, rec: _Rec) -> None:
        """Under the lock (does not touch the file)."""
        name = _key_name(rec.key)
        if self._lru.pop((rec.model_dir, name), None) is None:
            return
        trie = self._tries.get(rec.model_dir)
        if trie is not None:
            trie.remove(rec.key)
            if not trie.size:
                del self._tries[rec.model_dir]
        self._nbytes -= rec.size

    def _drop(self, rec: _Rec) -> None:
        """Under the lock: remove from the index and delete the file."""
        self._index_remove(rec)
        _unlink(self.directory / rec.model_dir / _key_name(rec.key))

    def _rebuild(self) -> None:
        found = []
        now = time.time()
        for sub in sorted(self.directory.iterdir()) if self.directory.is_dir() else []:
            if not sub.name[:1].isalnum() or not self._secure_dir(sub, create=False):
                continue
            for p in sub.iterdir():
                if p.name.startswith((".tmp-", ".claim-")):
                    try:
                        if now - p.lstat().st_mtime > _STALE_S:
                            _unlink(p)
                    except OSError:
                        pass
                    continue
                if not _ENTRY_NAME.match(p.name) or not p.is_file():
                    continue
                try:
                    _, meta = _read_header(p)
                    key = meta["__key__"]
                    if self.model_dir_name(meta.get("model_key")) != sub.name or _key_name(key) != p.name:
                        raise _Corrupt("misplaced file")
                    st = p.stat()
                except (OSError, _Corrupt, ValueError, KeyError, TypeError) as e:
                    log.warning("kvplugin: removing unreadable cache file %s: %s", p, e)
                    self.counters["corrupt"] += 1
                    _unlink(p)
                    continue
                rec = _Rec(sub.name, key, st.st_size, meta.get("trimmable") == "1")
                found.append((st.st_mtime, p.name, rec))
        found.sort(key=lambda t: t[0])
        with self._lock:
            for _, name, rec in found:
                self._index_add(rec, name)
            self._enforce(keep=None)

    def _enforce(self, keep) -> None:
        """Under the lock: delete LRU files until within budget."""
        while self._nbytes > self.max_bytes and self._lru:
            rec = next(iter(self._lru.values()))
            if rec is keep:
                break
            self._drop(rec)
            self.counters["evictions"] += 1

    # ---------------------------------------------------------------- put

    def put(self, model_key: str, tokens: Sequence[int], cache: list) -> bool:
        """Write ``cache`` (atomically).  False if refused (closed, unsupported layer
        kind, larger than ``max_bytes``, I/O error)."""
        key = to_key(tokens)
        if self._closed or not key or not cache:
            return False
        try:
            arrays, layers = serialize_cache(cache)
        except (_Unsupported, AttributeError) as e:
            log.debug("kvplugin: not spilling entry: %s", e)
            self._count("refused")
            return False
        if sum(a.nbytes for a in arrays.values()) > self.max_bytes:
            self._count("refused")
            return False
        trimmable = can_copy_prefix(cache, len(key))
        arrays[TOKENS] = mx.array(key, dtype=mx.int64)
        meta = {
            "format": FORMAT,
            "model_key": str(model_key),
            "n_tokens": str(len(key)),
            "trimmable": "1" if trimmable else "0",
            "layers": json.dumps(layers, separators=(",", ":")),
        }
        mdir_name = self.model_dir_name(model_key)
        mdir = self.directory / mdir_name
        name = _key_name(key)
        if not self._secure_dir(mdir, create=True):
            return False
        tmp = mdir / f".tmp-{uuid.uuid4().hex}{SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                mx.save_safetensors(f, arrays, meta)
                f.flush()
                os.fsync(f.fileno())
            size = os.stat(tmp).st_size
            del arrays
            if size > self.max_bytes:
                raise OSError("entry larger than max_bytes")
            with self._lock:
                if self._closed:
                    raise OSError("closed")
                os.replace(tmp, mdir / name)
                _fsync_dir(mdir)
                rec = _Rec(mdir_name, key, size, trimmable)
                self._index_add(rec, name)
                if trimmable:
                    for _, prev in self._tries[mdir_name].prefixes_of(key):
                        self._drop(prev)
                        self.counters["superseded"] += 1
                self._enforce(keep=rec)
                self.counters["puts"] += 1
            return True
        except Exception as e:
            log.warning("kvplugin: cold tier write failed: %s", e)
            _unlink(tmp)
            self._count("refused")
            return False

    # ---------------------------------------------------------------- fetch

    def _plan(self, model_key, key):
        trie = self._tries.get(self.model_dir_name(model_key))
        if trie is None:
            return None
        return choose(trie, key, trimmable=lambda r: r.trimmable, copyable=lambda r, n: r.trimmable)

    def probe(self, model_key: str, tokens: Sequence[int]) -> int:
        """Tokens ``fetch`` would cover now (index only, no I/O; 0 if none)."""
        key = tokens if isinstance(tokens, tuple) else to_key(tokens)
        with self._lock:
            plan = self._plan(model_key, key)
        if plan is None:
            return 0
        mode, rec, n = plan
        return len(rec.key) if mode == "move" else n

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
                claim = path.with_name(f".claim-{uuid.uuid4().hex}{SUFFIX}")
                self._index_remove(rec)
                try:
                    os.replace(path, claim)
                except OSError:
                    self.counters["misses"] += 1
                    return None
                path, n = claim, len(rec.key)
            else:
                self._lru.move_to_end((rec.model_dir, _key_name(rec.key)))
                try:
                    os.utime(path)
                except OSError:
                    pass
        try:
            cache = self._load(path, model_key, rec.key)
        except Exception as e:  # corrupted / truncated / vanished: a miss, file removed
            log.warning("kvplugin: dropping unreadable cache file %s: %s", path, e)
            with self._lock:
                self.counters["corrupt"] += 1
                self.counters["misses"] += 1
                if mode == "copy" and self._lru.get((rec.model_dir, _key_name(rec.key))) is rec:
                    self._drop(rec)
            if mode == "move":
                _unlink(path)
            return None
        if mode == "move":
            _unlink(path)
            with self._lock:
                self.counters["hits"] += 1
            return cache, n
        out = copy_prefix(cache, n)
        del cache
        with self._lock:
            self.counters["copies" if out is not None else "misses"] += 1
        return (out, n) if out is not None else None

    def _load(self, path: Path, model_key, key: tuple) -> list:
        _, meta = _read_header(path)
        if meta["__key__"] != key or meta.get("model_key") != str(model_key):
            raise _Corrupt("file does not hold this entry")
        layers = json.loads(meta["layers"])
        arrays = mx.load(str(path))
        arrays.pop(TOKENS, None)
        cache = deserialize_cache(arrays, layers)
        mx.eval(list(arrays.values()))  # read everything now (the file may go away)
        return cache
