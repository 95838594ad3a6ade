"""What the engine benchmark measures with: MLX memory above a baseline, a KV geometry, and
seeded random fp16 keys/values, shared by every workload so that their numbers compare."""

from __future__ import annotations

import gc
from dataclasses import dataclass

from kvplugin.tools.bench.report import fmt_bytes

__all__ = ["mlx_core", "MemoryMeter", "Geometry", "random_fp16"]


def mlx_core():
    """``mlx.core``, imported on first use: importing the benchmark stays cheap."""
    import mlx.core as mx

    return mx


class MemoryMeter:
    """Bytes above a baseline taken at construction (after dropping MLX's buffer cache)."""

    def __init__(self) -> None:
        mx = mlx_core()
        gc.collect()
        mx.clear_cache()
        self.base = mx.get_active_memory()

    def active(self) -> int:
        return mlx_core().get_active_memory() - self.base

    def reset_peak(self) -> None:
        mlx_core().reset_peak_memory()

    def peak(self) -> int:
        mx = mlx_core()
        return max(mx.get_peak_memory(), mx.get_active_memory()) - self.base


@dataclass
class Geometry:
    """The KV shape of the synthetic data; every byte figure scales from ``bytes_per_token``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:  # K and V, every layer
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} head_dim, fp16 "
                f"({fmt_bytes(self.bytes_per_token)}/token)")


def random_fp16(shape: tuple[int, ...], seed: int):
    """Seeded normal fp16 data, so that stock and kvplugin take the very same tensors."""
    mx = mlx_core()
    return mx.random.normal(shape, dtype=mx.float16, key=mx.random.key(seed))
