"""The numpy restore MLX's CPU backend uses (kvplugin.cache.codec.cpu_dequantize) against MLX's own
kernels, which a GPU uses: the same layer, every rotated codec, byte-filling widths, narrow
dtypes, protected rows, prompt boundaries and trims restore to the same values within
rounding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvplugin.cache.codec import cpu_dequantize as cpu_restore
from kvplugin.cache.codec import rows as quantize_rows
from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry

H, D = 2, 64
#: 2 ulps of the output dtype, relative to the layer's largest value: the MLX path rounds to
#: the entry's dtype before the rotation as well as after it, this one only after
TOLERANCE = {mx.float32: 2e-6, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _entry(n: int, dtype, seed: int = 0) -> list:
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
    k = k * mx.array(np.where(np.arange(D) % 16 == 3, 20.0, 1.0).astype(np.float32))
    v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1))
    c = KVCache()
    c.update_and_fetch(k.astype(dtype), v.astype(dtype))
    mx.eval(c.keys, c.values)
    return [c]


def _restored(stored: list, monkeypatch, numpy_path: bool, key_ropes=None) -> KVCache:
    with monkeypatch.context() as m:
        m.setattr(quantize_rows, "restores_here", lambda codec, kbits, vbits: numpy_path)
        return dequantize_entry(list(stored), key_ropes=key_ropes)[0]


def _same(a: mx.array, b: mx.array, dtype) -> bool:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.abs(a - b).max()) <= TOLERANCE[dtype] * float(mx.abs(b).max())


def _rms(a: mx.array, b: mx.array) -> float:
    return float(mx.sqrt(((a.astype(mx.float32) - b.astype(mx.float32)) ** 2).mean()))


@pytest.mark.parametrize("codec", ["rotated", "rotated-channel", "rotated-channel-sym"])
@pytest.mark.parametrize("kbits,vbits", [(8, 8), (4, 4), (2, 2), (8, 4), (5, 4), (3, 4), (6, 8), (4, 3), (5, 5), (8, 6)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_numpy_restore_equals_mlx_kernels(codec, kbits, vbits, dtype, monkeypatch):
    n = 150  # not a multiple of the group: the per-channel keys' last group is short
    src = _entry(n, dtype)
    protect = dict(sink_tokens=4, recent_tokens=16, prompt_boundaries=(70,))
    stored = quantize_entry(src, bits=kbits, value_bits=vbits, group_size=32 if kbits == 2
                            else 64, codec=codec, **protect).cache
    here, mlx_kernels = (_restored(stored, monkeypatch, p) for p in (True, False))
    assert _same(here.keys, mlx_kernels.keys, dtype) and _same(here.values, mlx_kernels.values,
                                                               dtype)
    assert here.offset == mlx_kernels.offset == n
    for name in ("keys", "values"):  # and no further from what was stored
        original = getattr(src[0], name)[..., :n, :]
        assert _rms(getattr(here, name), original) <= 1.01 * _rms(getattr(mlx_kernels, name),
                                                                   original)
    for rows in (slice(0, 4), slice(54, 70), slice(n - 16, n)):
        # the full-precision rows come back as they were
        assert mx.array_equal(here.keys[..., rows, :], src[0].keys[..., rows, :])
        assert mx.array_equal(here.values[..., rows, :], src[0].values[..., rows, :])


@pytest.mark.parametrize("codec", ["rotated", "rotated-channel"])
def test_a_trimmed_entry_restores_its_first_tokens_the_same_on_both_paths(codec, monkeypatch):
    stored = quantize_entry(_entry(200, mx.float16), bits=4, group_size=64, codec=codec,
                            sink_tokens=4).cache
    stored[0].trim(77)  # 123 tokens left: the arrays keep their rows, the offset drops
    here, mlx_kernels = (_restored(stored, monkeypatch, p) for p in (True, False))
    assert here.keys.shape[-2] == 123
    assert _same(here.keys, mlx_kernels.keys, mx.float16)
    assert _same(here.values, mlx_kernels.values, mx.float16)


def test_the_numpy_path_takes_rotated_codes_on_the_cpu_only(monkeypatch):
    assert mx.default_device() == mx.cpu  # this suite runs MLX on the CPU
    assert cpu_restore.restores_here("rotated-channel", 4, 4)
    assert cpu_restore.restores_here("rotated-channel-sym", 8, 2)
    assert not cpu_restore.restores_here("affine", 8, 8)  # one fused MLX kernel already
    assert cpu_restore.restores_here("rotated-channel", 5, 4)  # codes straddling bytes
    assert cpu_restore.restores_here("rotated", 4, 3)
    assert cpu_restore.restores_here("rotated", 4, 6)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # no GPU backend to switch to
    assert not cpu_restore.restores_here("rotated-channel", 4, 4)


def test_a_real_restore_takes_the_numpy_path_on_the_cpu(monkeypatch):
    """Through dequantize_entry, unpatched: 4- and 3-bit rotated layers go to numpy, 8-bit
    affine to MLX's kernel."""
    taken = []
    real = cpu_restore.restore_layer
    monkeypatch.setattr(quantize_rows, "restore_layer", lambda *a: taken.append(a[1]) or real(*a))
    for codec, bits in (("rotated-channel", 4), ("affine", 8), ("rotated-channel", 3)):
        stored = quantize_entry(_entry(80, mx.float16), bits=bits, group_size=64, codec=codec,
                                ).cache
        assert dequantize_entry(stored)[0].keys.shape == (1, H, 80, D)
    assert taken == ["rotated-channel", "rotated-channel"]


@pytest.mark.parametrize("codec,kbits", [("rotated-channel", 4), ("rotated-channel-sym", 3)])
@pytest.mark.parametrize("prerope", [False, True])
def test_a_wrapped_ring_restores_the_same_on_both_paths(codec, kbits, prerope, monkeypatch):
    """A ring whose newest slots wrap past its end (three protected ranges, stored at full
    precision only: the codes hold the slots between them), keys post- or pre-RoPE."""
    from mlx_lm.models.cache import RotatingKVCache

    from kvplugin.cache.codec.protected import protected_ranges
    from kvplugin.cache.model.rope import KeyRope
    from kvplugin.codecs import RING_SLOTS_ATTR

    ring = RotatingKVCache(64, 4)
    for i in range(130):  # one token at a time: the newest at slot 9, recent rows wrap
        k = mx.random.normal((1, H, 1, D), key=mx.random.key(i)).astype(mx.float16)
        ring.update_and_fetch(k, k * 0.5)
    mx.eval(ring.keys, ring.values)
    ropes = [KeyRope(D, False, 10000.0, 1.0)] if prerope else None
    stored = quantize_entry([ring], bits=kbits, group_size=64, codec=codec, sink_tokens=4,
                            recent_tokens=16, key_ropes=ropes).cache
    assert getattr(stored[0], RING_SLOTS_ATTR) == 64 and stored[0].keys[0].shape[-2] == 44
    here, mlx_kernels = (_restored(stored, monkeypatch, p, ropes) for p in (True, False))
    assert _same(here.keys, mlx_kernels.keys, mx.float16)
    assert _same(here.values, mlx_kernels.values, mx.float16)
    ranges = protected_ranges(stored[0])
    assert len(ranges) == 3 and sum(c for _, c in ranges) == 20  # the keep, two recent runs
    for rows in (slice(a, a + c) for a, c in ranges):
        assert mx.array_equal(here.keys[..., rows, :], ring.keys[..., rows, :])
        assert mx.array_equal(here.values[..., rows, :], ring.values[..., rows, :])
