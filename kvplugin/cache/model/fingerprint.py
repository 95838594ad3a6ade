"""The store's model key: a fingerprint of the served checkpoint.

Both hosts key stored entries by model; entries persisted in the cold tier must never be
served to a different model or a changed checkpoint, so the key hashes what identifies the
files (config/tokenizer JSON contents, weight names, sizes and sampled bytes; never the
path, so replicas of one checkpoint share entries) and the mlx-lm minor version (the cache format's owner). Host-independent:
a host passes whatever names its model (a path, a repo id, or mlx-lm's
``(model_path, adapter_path, draft_model_path)`` key).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any


_FP_LOCK = threading.Lock()
_FINGERPRINTS: dict[Any, str] = {}
_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf")


def _resolve_local(path: str) -> Path | None:
    """A local directory for a model path or a repo id already in the HF cache."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p.resolve()
    if p.is_file():
        return p.resolve()
    try:  # a repo id: the snapshot folder (named by commit) if it is cached
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(path, "config.json")
        if isinstance(hit, str):
            return Path(hit).parent
    except Exception:
        pass
    return None


_SAMPLE = 1 << 16


def _file_digest(path: Path, h: Any) -> None:
    """A weight file's size and three 64 KiB samples of its bytes (start, middle, end).

    Why samples, not the mtime or the path: replicas on other machines (or another copy of
    the same checkpoint) must get the same key to share entries through the remote tier,
    and a fine-tune of the same architecture differs in the samples. Hashing gigabytes
    of weights at every start would not be affordable."""
    size = path.stat().st_size  # follows HF-cache symlinks into the blobs
    h.update(f"{size}\0".encode())
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(offset)
            h.update(f.read(_SAMPLE))


def _dir_digest(path: Path, h: Any) -> None:
    """Feed what identifies a model/adapter directory's contents into ``h``."""
    if path.is_file():
        h.update(b"file\0")
        _file_digest(path, h)
        return
    for name in sorted(os.listdir(path)):
        f = path / name
        if name.endswith(".json"):
            try:
                h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
            except OSError:
                pass
        elif name.endswith(_WEIGHT_SUFFIXES):
            try:
                h.update(name.encode() + b"\0")
                _file_digest(f, h)
            except OSError:
                continue


def model_fingerprint(model: Any) -> str:
    """The store's key for the ``model`` mlx-lm's server passes to its prompt cache.

    That is ``ModelProvider.model_key`` = ``(model_path, adapter_path, draft_model_path)``
    in 0.31.3 and 0.32.x (an opaque object elsewhere). The key names the model and hashes
    what identifies its files (config/tokenizer JSON contents; weight names, sizes and three
    sampled 64 KiB of each; never the path) and the mlx-lm minor version, so
    entries persisted in the cold tier are never served to a different model or a changed
    checkpoint. Computed once per model key.
    """
    with _FP_LOCK:
        try:
            cached = _FINGERPRINTS.get(model)
        except TypeError:  # unhashable
            cached = None
        if cached is not None:
            return cached
    parts = list(model) if isinstance(model, tuple) else [model]
    while len(parts) > 1 and parts[-1] is None:  # (path, None, None) is the path alone
        parts.pop()
    h = hashlib.sha256()
    h.update(f"mlx-lm {_host_minor()}\0".encode())
    name = "model"
    for i, part in enumerate(parts):
        local = _resolve_local(os.fspath(part)) if isinstance(part, (str, os.PathLike)) else None
        if local is None:  # a repo id not cached here, an object: its name
            h.update(f"[{i}]{part!r}\0".encode())
            continue
        # A local checkpoint is named by its contents, never its path: replicas with the
        # same files (another machine, another copy) get the same key.
        h.update(f"[{i}]local\0".encode())
        if i == 0:
            name = local.name if local.name not in ("", ".") else name
        try:
            _dir_digest(local, h)
        except OSError:
            h.update(str(local).encode() + b"\0")
    if parts and isinstance(parts[0], str) and name == "model":
        name = parts[0].rstrip("/").rsplit("/", 1)[-1] or name
    key = f"{name}-{h.hexdigest()[:24]}"
    with _FP_LOCK:
        try:
            _FINGERPRINTS[model] = key
        except TypeError:
            pass
    return key


def _host_minor() -> str:
    """mlx-lm's minor version: its cache files do not cross minor releases."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("mlx-lm").split(".")[:2]
    except (PackageNotFoundError, ValueError):
        return "?"
    return f"{major}.{minor}"
