"""Handing memory that kvplugin frees back to the operating system.

Why: MLX keeps every freed buffer in its own buffer cache, to reuse it for the next array of
the same size. That is right for decode steps, but wrong for evicted prompt-cache entries: an
evicted entry's buffers are rarely the size of anything that comes next, and while MLX holds
them the process footprint does not move (a vllm-mlx user cleared a 15 GB prefix cache and the
footprint fell by 32 KB). So after kvplugin evicts entries it releases MLX's buffer cache.
``mx.clear_cache`` frees only buffers nothing uses, so it is safe from any thread; it costs a
few ``free`` calls, and only when something was evicted, never per decode step.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import mlx.core as mx

__all__ = ["buffer_cache_bytes", "mlx_memory", "release_buffer_cache", "trim_heap"]


def buffer_cache_bytes() -> int:
    """What MLX's buffer cache holds now (freed buffers kept for reuse)."""
    return int(mx.get_cache_memory())


def release_buffer_cache() -> int:
    """Empty MLX's buffer cache; returns the bytes it held (what went back to the system)."""
    held = int(mx.get_cache_memory())
    if held:
        mx.clear_cache()
        trim_heap()
    return held - int(mx.get_cache_memory())


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """On Linux, MLX's CPU buffers come from ``malloc``; glibc keeps freed pages in the middle
    of its heap resident until asked, so the process RSS would not fall. (On a Mac, Metal
    buffers go straight back to the system.) Also called once at the end of kvplugin's own
    start-up work (settings, the model probe, codec warm-up): what that freed is handed back
    before the host loads its model and serves, so it does not sit under the host's peaks."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def mlx_memory() -> dict[str, int]:
    """The whole process's MLX memory as MLX counts it: arrays alive, freed buffers held, and
    the peak of arrays alive since the process started."""
    return {"mlx_active_memory": int(mx.get_active_memory()),
            "mlx_cache_memory": int(mx.get_cache_memory()),
            "mlx_peak_memory": int(mx.get_peak_memory())}
