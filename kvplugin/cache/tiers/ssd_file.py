"""One cold-tier entry file: its format, and reading its header without loading its data.

Why apart from the tier: what a file *is* (names, metadata, digest, header checks) is fixed by
the format and read by every process sharing a directory; the tier
(:mod:`kvplugin.cache.tiers.ssd`) decides which files exist.

* One safetensors file per entry, written with ``mx.save_safetensors`` (no pickle;
  all mlx dtypes incl. bf16/fp16 and packed uint32 round-trip).  Tensors:
  ``__tokens__`` (int64, the entry's token key) and the layers' arrays, named
  ``l<i>.<field>[.<j>]`` (``CacheList`` children ``l<i>.c<j>.``).  String metadata:
  ``format`` (``kvplugin.cache/2``), ``digest`` (``blake2b:<hex>`` over every tensor's
  name, dtype, shape and bytes, verified before an entry is used: damaged data is a
  counted miss and the file is removed, never served), ``model_key``, ``n_tokens``,
  ``trimmable``
  (``"1"`` if a prefix of the entry can be copied, see ``layers.can_copy_prefix``)
  and ``layers``: JSON, one descriptor per layer: ``kind`` (mlx-lm base class used
  for the layout), ``cls`` (``module:qualname`` of the real class), ``attrs``
  (scalars: offset, step, max_size, keep, _idx, bits, group_size, chunk_size,
  start_position and any scalar instance attribute of a subclass), ``arrays``.
* Only the used positions are written (``keys[..., :offset, :]``; a rotating cache
  that has wrapped is written whole with its ``_idx``).  Quantized layers stay
  quantized (packed + scales + biases) on disk and after reload.
* Supported layer kinds: ``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache``,
  ``ChunkedKVCache``, ``ConcatenateKVCache``, ``ArraysCache``, ``CacheList`` and
  their subclasses whose extra instance attributes are plain scalars, and kvplugin's
  ``QuantizedRotatingKVCache`` (a rotating layer stored quantized); a bounded
  ``PreallocatedRotatingKVCache`` is stored without its undo log (see
  :mod:`kvplugin.cache.tiers.serialize`).  The tier refuses anything else: counted by reason
  (``refused_by_reason``: ``unsupported:<class>``) and said once.  On load the real class
  is used if its module is already imported (nothing is imported from file data) and it
  subclasses the recorded kind; otherwise the kind's mlx-lm class.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import sys
from array import array
from pathlib import Path

import mlx.core as mx

from kvplugin.cache.store.index import tokens_bytes
from kvplugin.cache.tiers.serialize import Corrupt

__all__ = ["ENTRY_NAME", "FORMAT", "SUFFIX", "TOKENS", "fsync_dir", "is_regular", "key_name",
           "model_dir_name", "read_header", "tensor_digest", "unlink"]

FORMAT = "kvplugin.cache/2"  # 2: every file carries a digest of its tensor data
DIGEST = "blake2b"
TOKENS = "__tokens__"
SUFFIX = ".safetensors"
ENTRY_NAME = re.compile(r"^[0-9a-f]{40}" + re.escape(SUFFIX) + "$")
MAX_HEADER = 256 << 20


def tensor_digest(arrays: dict) -> str:
    """``blake2b:<hex>`` over every tensor's name, dtype, shape and raw bytes, in name order.

    Why: a header check catches truncation, not flipped bytes inside the data, and damaged
    keys silently change answers (and get copied into newer entries). blake2b from the
    standard library costs a few ms per MiB of entry (docs/benchmarks.md).
    """
    import numpy as np

    h = hashlib.blake2b(digest_size=32)
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(memoryview(np.asarray(mx.contiguous(a).view(mx.uint8))))
    return f"{DIGEST}:{h.hexdigest()}"


def model_dir_name(model_key: object) -> str:
    """``<slug>-<sha256(model_key)[:16]>``: one model's subdirectory (slug: a readable tail)."""
    s = str(model_key)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", s)[-48:].lstrip("._-") or "model"
    return f"{slug}-{hashlib.sha256(s.encode()).hexdigest()[:16]}"


def key_name(key: tuple) -> str:
    return hashlib.sha256(tokens_bytes(key)).hexdigest()[:40] + SUFFIX


def read_header(path: Path) -> tuple[dict, dict]:
    """Parse and validate a safetensors header.  Returns (tensors, metadata).
    Also reads the ``__tokens__`` tensor, returned as metadata["__key__"]."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with os.fdopen(os.open(path, flags), "rb") as f:  # never through a symlink (ELOOP)
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise Corrupt("not a regular file")
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise Corrupt("short file")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > min(size - 8, MAX_HEADER):
            raise Corrupt("bad header length")
        try:
            header = json.loads(f.read(hlen))
        except ValueError as e:
            raise Corrupt("bad header json") from e
        if not isinstance(header, dict):
            raise Corrupt("bad header")
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise Corrupt("not a kvplugin cache file")
        end = 0
        for t in header.values():
            lo, hi = t["data_offsets"]
            if not 0 <= lo <= hi:
                raise Corrupt("bad offsets")
            end = max(end, hi)
        if 8 + hlen + end != size:
            raise Corrupt(f"size {size} != {8 + hlen + end} (truncated?)")
        tok = header.get(TOKENS)
        if not tok or tok.get("dtype") != "I64":
            raise Corrupt("no token key")
        lo, hi = tok["data_offsets"]
        n = int(meta.get("n_tokens", -1))
        if hi - lo != 8 * n or tok.get("shape") != [n] or n < 1:
            raise Corrupt("token key size mismatch")
        f.seek(8 + hlen + lo)
        buf = f.read(hi - lo)
    a = array("q")
    a.frombytes(buf)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    meta["__key__"] = tuple(a)
    return header, meta


def fsync_dir(path: Path) -> None:
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


def is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
