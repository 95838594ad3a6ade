"""Faults an operator's disk produces, made on a real SSD tier directory (shared by the tier
fault tests). Mounting needs root (as here and in CI); a mount that fails fails the test and
says why: these tests never skip."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import harness

ENTRY_GLOB = "*/[0-9a-f]*.safetensors"


def entry_files(ssd_dir: Path) -> list[Path]:
    """The tier's entry files under ``ssd_dir`` (every model subdirectory)."""
    return sorted(p for p in Path(ssd_dir).glob(ENTRY_GLOB) if not p.name.startswith("."))


def narrow_entries(files: list[Path], width: int) -> int:
    """Rewrite every entry with its keys and values cut to ``width`` channels (head_dim 32
    for a 64 model): internally consistent, with a VALID digest, so only a check against the
    model can refuse it. ``files``: entry files (:func:`entry_files`). Returns how many."""
    import re

    import mlx.core as mx

    from kvplugin.cache.tiers.ssd import tensor_digest

    for path in files:
        arrays, meta = mx.load(str(path), return_metadata=True)
        for name in list(arrays):
            if re.fullmatch(r"l\d+\.(keys|values)", name):
                arrays[name] = mx.contiguous(arrays[name][..., :width])
        meta["digest"] = tensor_digest(arrays)
        mx.save_safetensors(str(path), arrays, meta)
    return len(files)


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(
            f"mount {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}; these "
            "tests need root and mount(8) (util-linux), as in CI; they do not skip")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, text=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` bind-mounted read-only over itself (root ignores file modes, a mount does
    not); unmounted at the end."""
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,bind,ro", str(path))
        probe = Path(path) / ".probe"
        try:
            probe.touch()
        except OSError:
            pass
        else:
            probe.unlink()
            raise AssertionError(f"{path} is still writable after a read-only remount")
        yield Path(path)
    finally:
        _umount(path)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -t tmpfs -o size=...``) on ``path``; unmounted at the end."""
    Path(path).mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    try:
        yield Path(path)
    finally:
        _umount(path)


def disk_usage(path: Path) -> int:
    """Bytes of every file under ``path`` (entries, temp files, markers)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def breaking_plugin(where: Path) -> tuple[dict[str, str], Path]:
    """Env installing a plugin (a real entry point on PYTHONPATH) whose
    ``kvplugin_dequantize_entry`` hands the host a broken entry (layer 0's keys cut to 32
    channels) on the next fetch after the returned trigger file is created (one shot, it
    removes the file): an error that only shows while the host uses the entry, after every
    check kvplugin makes."""
    where = Path(where)
    trigger = where / "break-next-fetch"
    env = harness.plugin_on_path(where, "break", (
        "import os\n"
        "import mlx.core as mx\n"
        "from kvplugin.hookspecs import hookimpl\n\n"
        f"TRIGGER = {str(trigger)!r}\n\n"
        "@hookimpl\n"
        "def kvplugin_dequantize_entry(cache, settings):\n"
        "    if os.path.exists(TRIGGER):\n"
        "        os.unlink(TRIGGER)\n"
        "        cache[0].keys = mx.contiguous(cache[0].keys[..., :32])\n"
        "    return None\n"
    ))
    return env, trigger


_WRITER = """
import sys
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from kvplugin.cache.tiers.ssd import SSDTier

n = 1 << 17  # 128 Ki tokens x 8 heads x 64 x fp16: 128 MiB each for keys and values
layer = KVCache()
k = mx.random.normal((1, 8, n, 64)).astype(mx.float16)
layer.update_and_fetch(k, k)
mx.eval(layer.keys, layer.values)
print("ready", flush=True)
SSDTier(sys.argv[1], 1 << 40).put("killed-writer", list(range(n)), [layer])
"""


def kill_mid_spill(ssd_dir: Path, timeout: float = 120.0, *, min_bytes: int = 1) -> Path:
    """``kill -9`` a real writer (the tier's own ``put``, in its own process) while its
    256 MiB entry is being written, once its temp file holds at least ``min_bytes``; returns
    the ``.tmp-*`` file it leaves behind."""
    import os
    import signal
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(ssd_dir)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", "the writer did not start"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            temps = [p for p in Path(ssd_dir).glob("*/.tmp-*") if p.stat().st_size >= min_bytes]
            if temps:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                assert temps[0].exists()
                return temps[0]
            if proc.poll() is not None:
                raise AssertionError("the writer finished before it could be killed mid-spill")
            time.sleep(0.002)
        raise AssertionError("the writer never started its spill")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def fill_disk(path: Path, leave: int) -> Path:
    """Fill the file system of ``path`` with a filler file (not the tier's), then give back
    ``leave`` bytes of it; returns the filler (grow it again with ``fill_disk``)."""
    import errno
    import os

    filler = Path(path) / "operator-filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    size = filler.stat().st_size
    with open(filler, "r+b") as f:
        f.truncate(max(0, size - leave))
    return filler
