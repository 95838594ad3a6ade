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

from functools import lru_cache

import mlx.core as mx
import numpy as np

__all__ = ["CODEC_SEED", "rotation", "rotatable", "rotate", "unrotate"]

CODEC_SEED = 20251124  # recorded per layer; changing it never misreads old entries


def rotatable(width: int) -> bool:
    """A Sylvester Hadamard exists for powers of two only."""
    return width > 0 and width & (width - 1) == 0


@lru_cache(maxsize=16)
def _matrix(width: int, seed: int) -> np.ndarray:
    if not rotatable(width):
        raise ValueError(f"the rotated codec needs a power-of-two width, got {width}")
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < width:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), size=width)
    return (signs[:, None] * h / np.sqrt(width)).astype(np.float32)  # diag(s) @ H, orthogonal


def rotation(width: int, seed: int = CODEC_SEED) -> mx.array:
    """The ``width x width`` orthogonal matrix R (fp32); rows are applied as ``x @ R``."""
    return mx.array(_matrix(width, seed))


def rotate(x: mx.array, seed: int = CODEC_SEED) -> mx.array:
    """``x @ R`` along the last axis, computed in fp32, returned in ``x``'s dtype."""
    r = rotation(x.shape[-1], seed)
    return (x.astype(mx.float32) @ r).astype(x.dtype)


def unrotate(x: mx.array, seed: int = CODEC_SEED, dtype=None) -> mx.array:
    """Inverse of :func:`rotate`: ``x @ R.T``."""
    r = rotation(x.shape[-1], seed)
    return (x.astype(mx.float32) @ r.T).astype(dtype or x.dtype)
