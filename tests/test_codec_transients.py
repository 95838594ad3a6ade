"""The codec passes on MLX's CPU keep small temporaries, with the same results.

Why: a codec pass's temporaries are per layer, so on a model with few layers they are a large
share of the entry. Before, restoring an 8-bit entry of the offline demo's 2-layer fp16 model
peaked at 4.4x the entry in MLX (``mx.dequantize``'s CPU chain widens every code to a uint32)
and quantizing a 4-bit one at 6.6x (per-channel scales repeated to every token), which put the
real server's MLX peak above stock's. The peaks asserted here are MLX's own byte counts for one
stream: deterministic."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvplugin.cache.codec.channel import pack_codes, quantize_channels, unpack_codes
from kvplugin.cache.codec.cpu_dequantize import dequantize

DTYPES = [mx.float16, mx.bfloat16, mx.float32]


def _peak_over(f) -> tuple[float, mx.array]:
    """MLX's peak while ``f()`` is evaluated, above what was held before, and the result."""
    mx.eval(f())  # kernels loaded, nothing of it kept
    mx.clear_cache()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    out = f()
    mx.eval(out)
    return mx.get_peak_memory() - held, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequantize_is_mx_dequantize_bit_for_bit(dtype, bits):
    x = (mx.random.normal((1, 2, 150, 64), key=mx.random.key(bits)) * 3).astype(dtype)
    words, scales, biases = mx.quantize(x, group_size=64, bits=bits)
    for n in (150, 97):  # whole, and a cut (strided) prefix as a trimmed entry reads it
        parts = [a[..., :n, :] for a in (words, scales, biases)]
        want = mx.dequantize(*parts, group_size=64, bits=bits)
        got = dequantize(*parts, 64, bits)
        assert got.dtype == want.dtype == dtype and mx.array_equal(got, want)


@pytest.mark.parametrize("bits,most", [(8, 1.0), (4, 2.0), (2, 2.0)])
def test_dequantize_holds_at_most_its_output_and_the_codes_as_bytes(bits, most):
    x = mx.random.normal((1, 2, 1135, 64)).astype(mx.float16)
    parts = mx.quantize(x, group_size=64, bits=bits)
    mx.eval(parts)
    peak, out = _peak_over(lambda: dequantize(*parts, 64, bits))
    assert peak <= most * out.nbytes + 4096, (peak / out.nbytes, bits)  # + a few scalars


def _reference_channels(x: mx.array, group: int, bits: int):
    """Per-channel quantization by its definition, in numpy (fp32 arithmetic): per group of
    ``group`` tokens (the last padded with its last token) and channel, scale and minimum
    rounded to ``x``'s dtype, codes ``clip(round((x - min) / scale))``."""
    *lead, n, width = x.shape
    rows = -(-n // group)
    x32 = np.array(x.astype(mx.float32))
    padded = np.concatenate([x32, np.repeat(x32[..., -1:, :], rows * group - n, axis=-2)], -2)
    grouped = padded.reshape(*lead, rows, group, width)
    low, high = grouped.min(axis=-2), grouped.max(axis=-2)
    levels = (1 << bits) - 1
    scales = mx.array((high - low) / np.float32(levels)).astype(x.dtype)
    mins = mx.array(low).astype(x.dtype)
    step = np.array(scales.astype(mx.float32))[..., None, :]
    base = np.array(mins.astype(mx.float32))[..., None, :]
    codes = np.clip(np.rint((grouped - base) / np.where(step > 0, step, 1)), 0, levels)
    return codes.reshape(*lead, rows * group, width)[..., :n, :], scales, mins


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [64, 150])
def test_channel_keys_are_the_definition_exactly(dtype, bits, n):
    x = (mx.random.normal((1, 2, n, 64), key=mx.random.key(n + bits)) * 4).astype(dtype)
    words, scales, mins = quantize_channels(x, 64, bits)
    codes, want_scales, want_mins = _reference_channels(x, 64, bits)
    assert mx.array_equal(scales, want_scales) and mx.array_equal(mins, want_mins)
    assert np.array_equal(np.array(unpack_codes(words, bits)), codes.astype(np.uint32))


def test_channel_keys_hold_a_few_layers_not_a_dozen():
    x = mx.random.normal((1, 2, 1135, 64)).astype(mx.float16)
    mx.eval(x)
    peak, _ = _peak_over(lambda: quantize_channels(x, 64, 4))
    assert peak <= 5 * x.nbytes, peak / x.nbytes  # was 12x


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_byte_packing_holds_bytes_not_words(bits):
    codes = mx.random.randint(0, 1 << bits, (1, 2, 1135, 64)).astype(mx.uint8)
    mx.eval(codes)
    peak, words = _peak_over(lambda: pack_codes(codes, bits))
    assert peak <= 2 * codes.nbytes, peak / codes.nbytes  # a uint32 per code would be 4x
    assert mx.array_equal(unpack_codes(words, bits), codes.astype(mx.uint32))


def _two_layer_entry(n: int, dtype=mx.float16, width: int = 128) -> list:
    from mlx_lm.models.cache import KVCache

    cache = []
    for seed in range(2):
        layer = KVCache()
        k, v = (mx.random.normal((1, 1, n, width), key=mx.random.key(seed * 2 + i)).astype(dtype)
                for i in range(2))
        layer.update_and_fetch(k, v)
        cache.append(layer)
    mx.eval([a for c in cache for a in (c.keys, c.values)])
    return cache


def _stored_arrays(cache: list) -> list:
    return [a for layer in cache for a in (*layer.keys, *layer.values)]


@pytest.mark.parametrize("codec,bits", [("rotated", 4), ("rotated-channel", 4),
                                        ("rotated-channel", 2), ("rotated-channel-sym", 3)])
@pytest.mark.parametrize("n", [100, 1549])
def test_row_chunks_store_what_one_pass_stores(codec, bits, n):
    """Chunks of 32 rows (the last one short; per-channel key groups of 32 never straddle
    two chunks) give the very arrays of one pass, protected rows included."""
    from kvplugin.cache.codec.quantize import quantize_entry

    kw = dict(bits=bits, group_size=32, codec=codec, sink_tokens=4, recent_tokens=16)
    one = quantize_entry(_two_layer_entry(n), chunk_bytes=0, **kw).cache
    chunked = quantize_entry(_two_layer_entry(n), chunk_bytes=32 * 256, **kw).cache
    for a, b in zip(_stored_arrays(one), _stored_arrays(chunked), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b), (a.shape, codec)


def test_a_4_bit_store_of_a_2_layer_model_holds_a_fraction_of_the_entry():
    """On a 2-layer model each layer is half the entry: one pass per layer (the rotation and
    per-channel keys, two lanes) peaked at 3.2x the entry above what it held, and a real
    server's process high-water mark on mlx-lm's sequential path rose ~2.8 MiB above stock's
    for a 1.5 MiB entry. In chunks of 1/32 of the entry it stays under half the entry."""
    from kvplugin.cache.codec.quantize import quantize_entry

    def store(chunk_bytes):
        cache = _two_layer_entry(1549)
        entry = sum(c.keys.nbytes + c.values.nbytes for c in cache)
        kw = dict(bits=4, group_size=64, codec="rotated-channel", sink_tokens=4, recent_tokens=16)
        mx.eval(_stored_arrays(quantize_entry(_two_layer_entry(64), **kw).cache))  # kernels
        mx.clear_cache()
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        out = quantize_entry(cache, consume=True, chunk_bytes=chunk_bytes, **kw).cache
        mx.eval(_stored_arrays(out))
        return (mx.get_peak_memory() - held) / entry

    assert store(None) < 0.5  # the default: 1/32 of the entry
    assert store(0) > 2.0  # one pass per layer: what it was


def test_a_model_with_many_layers_takes_one_pass_per_array(monkeypatch):
    """With 16 layers a layer's keys are 1/32 of the entry: no chunks, the two lanes kept."""
    from mlx_lm.models.cache import KVCache

    from kvplugin.cache.codec import rotation
    from kvplugin.cache.codec.quantize import quantize_entry

    passes: list[int] = []
    real = rotation.rotate
    monkeypatch.setattr(rotation, "rotate", lambda x, *a: passes.append(x.shape[-2]) or real(x, *a))
    cache = []
    for _ in range(16):
        layer = KVCache()
        layer.update_and_fetch(*(mx.random.normal((1, 1, 300, 64)).astype(mx.float16),) * 2)
        cache.append(layer)
    quantize_entry(cache, bits=4, group_size=64, codec="rotated-channel")
    assert passes == [300] * 32
    passes.clear()
    quantize_entry(cache[:2], bits=4, group_size=64, codec="rotated-channel")
    assert len(passes) > 4 and sum(passes) == 4 * 300  # 2 layers: chunked
