"""The ``rotated`` codec's transform: a fixed, seeded randomized Hadamard along head_dim.

Why: a few key channels of real models carry outliers ~10x the median channel; affine
quantization per token group then spends its whole range on them and rounds every other
channel coarsely. An orthogonal rotation spreads each outlier over all channels (the
Hadamard mixes every channel into every other with equal weight, the random signs keep
structured inputs from aligning with it), so the same bits lose far less. Being orthogonal,
it is undone exactly by its transpose after dequantization; attention never sees it.

The matrix depends only on ``(head_dim, seed)``, both recorded on the stored layer, so an
entry written by one process is read back correctly by another.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

__all__ = ["CODEC_SEED", "rotation", "rotatable", "rotate", "unrotate"]

CODEC_SEED = 20251124  # recorded per layer; changing it never misreads old entries


def rotatable(width: int) -> bool:
    """A Sylvester Hadamard exists for powers of two only."""
    return width > 0 and width & (width - 1) == 0


@lru_cache(maxsize=16)
def _signs(width: int, seed: int) -> np.ndarray:
    if not rotatable(width):
        raise ValueError(f"the rotated codec needs a power-of-two width, got {width}")
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), size=width)


def _matrix(width: int, seed: int) -> np.ndarray:
    signs = _signs(width, seed)
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < width:
        h = np.block([[h, h], [h, -h]])
    return (signs[:, None] * h / np.sqrt(width)).astype(np.float32)  # diag(s) @ H, orthogonal


def rotation(width: int, seed: int = CODEC_SEED) -> mx.array:
    """The ``width x width`` orthogonal matrix R (fp32); rows are applied as ``x @ R``."""
    return mx.array(_matrix(width, seed))


# Applied as MLX's fast Walsh-Hadamard transform (``H`` is symmetric, Sylvester-ordered
# like ``_matrix``'s): ``x @ R = hadamard(x * s)``, ``x @ R.T = hadamard(x) * s``. Why not
# MLX's matmul: on the CPU two layers' codec work runs at once (kvplugin.cache.codec.lanes), and
# BLAS calls from two threads take turns while this kernel does not. Same transform,
# rounding within 2e-6. (A restore on the
# CPU does not come here: kvplugin.cache.codec.cpu_dequantize rotates back with numpy's GEMM.)
def rotate(x: mx.array, seed: int = CODEC_SEED) -> mx.array:
    """``x @ R`` along the last axis, computed in fp32, returned in ``x``'s dtype."""
    width = x.shape[-1]
    signs = mx.array(_signs(width, seed))
    return mx.hadamard_transform(x.astype(mx.float32) * signs,
                                 scale=1 / math.sqrt(width)).astype(x.dtype)


def unrotate(x: mx.array, seed: int = CODEC_SEED, dtype=None) -> mx.array:
    """Inverse of :func:`rotate`: ``x @ R.T``."""
    width = x.shape[-1]
    signs = mx.array(_signs(width, seed))
    out = mx.hadamard_transform(x.astype(mx.float32), scale=1 / math.sqrt(width)) * signs
    return out.astype(dtype or x.dtype)
