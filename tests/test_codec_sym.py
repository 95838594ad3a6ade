"""The ``rotated-channel-sym`` codec (``auto`` at 3 bits and below): ``rotated-channel``'s keys,
values per token with a scale and no minimum; its exact size, its layout under every cut the
store makes, the SSD tier, and damaged or relabelled records being misses."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvplugin.cache.layers import copy_prefix, dense_nbytes, entry_nbytes
from kvplugin.cache.codec.quantize import (
    CODEC_ATTR,
    UnknownCodec,
    codec_name,
    dequantize_entry,
    quantize_entry,
)
from kvplugin.cache.codec.symmetric import dequantize_symmetric, quantize_symmetric
from kvplugin.cache.tiers.ssd import SSDTier

from test_codecs import H, N, _err, _layer

SYM = "rotated-channel-sym"


def _sym(layer=None, **kw):
    kw = {"bits": 3, "group_size": 64, "codec": SYM} | kw
    return quantize_entry([layer or _layer()], **kw).cache


def test_stored_bytes_are_exactly_codes_plus_key_scales_and_value_scales():
    """Deterministic, so asserted exactly: per head and token 64 three-bit codes for keys and
    for values (24 + 24 bytes), one fp16 scale per 64 values (2 bytes), and per channel one
    fp16 scale and minimum per started group of 64 tokens; rotated-channel stores the same
    and a minimum beside every value scale."""
    q = _sym()[0]
    assert codec_name(q) == f"{SYM}-k3v3" and len(q.keys) == 3 and len(q.values) == 2
    key_rows = -(-N // 64)
    assert q.keys[1].shape[-2] == key_rows and q.values[1].shape[-1] == 1
    want = H * (N * 24 + key_rows * 64 * 2 * 2 + N * 24 + N * 2)
    assert entry_nbytes([q]) == want
    assert dense_nbytes(q) == H * N * 64 * 2 * 2  # what the fp16 entry held
    channel = quantize_entry([_layer()], bits=3, group_size=64, codec="rotated-channel").cache
    assert entry_nbytes(channel) - want == H * N * 2


def test_scale_only_values_are_symmetric_every_level_used_and_zeros_exact():
    ramp = mx.linspace(-7, 7, 64).reshape(1, 1, 1, 64)
    x = mx.concatenate([ramp, mx.zeros_like(ramp)], axis=-2)
    codes, scales = quantize_symmetric(x, 64, 3)
    back = dequantize_symmetric((codes, scales), 2, 64, 3, mx.float32)
    assert scales[0, 0, 0, 0].item() == pytest.approx(2.0)  # 7 / 3.5: the largest hits a level
    assert mx.array_equal(back[..., 1, :], mx.zeros((1, 1, 64)))  # an all-zero group
    levels = sorted(set(back[0, 0, 0].tolist()))
    assert levels == [(c - 3.5) * 2.0 for c in range(8)]  # 8 levels, symmetric around zero
    assert mx.abs(back[..., 0, :] - ramp[..., 0, :]).max().item() <= 1.0 + 1e-6  # scale / 2


@pytest.mark.parametrize("boundaries", [(), (150,)])
def test_prefix_cuts_trims_and_the_ssd_tier_keep_the_codec(tmp_path, boundaries):
    src = _layer()
    q = _sym(src, sink_tokens=4, recent_tokens=16, prompt_boundaries=boundaries)
    whole = dequantize_entry(q)[0]
    assert whole.offset == N and _err(whole.values, src.values[..., :N, :]) < 0.4
    k0 = src.keys[..., :N, :]
    assert mx.array_equal(whole.keys[..., :4, :], k0[..., :4, :])
    assert mx.array_equal(whole.keys[..., N - 16:, :], k0[..., N - 16:, :])
    if boundaries:
        assert mx.array_equal(whole.values[..., 134:150, :], src.values[..., 134:150, :])
    for m in (150, 65, 3):
        cut = copy_prefix(q, m)
        got = dequantize_entry(cut)[0]
        assert got.offset == m and mx.array_equal(got.keys, whole.keys[..., :m, :])
        assert mx.array_equal(got.values, whole.values[..., :m, :])
    tier = SSDTier(tmp_path / "ssd", max_bytes=1 << 30)
    tokens = list(range(N))
    assert tier.put("m", tokens, q)
    back = tier.fetch("m", tokens + [1])[0]
    assert getattr(back[0], CODEC_ATTR) == SYM
    got = dequantize_entry(back)[0]
    assert mx.array_equal(got.keys, whole.keys) and mx.array_equal(got.values, whole.values)


def _damaged(change):
    q = _sym(sink_tokens=4, recent_tokens=16)
    layer = copy.copy(q[0])
    change(layer)
    return [layer]


@pytest.mark.parametrize("change,match", [
    (lambda q: setattr(q, CODEC_ATTR, "rotated-channel"), "arrays past"),  # relabelled
    (lambda q: setattr(q, "values", q.values[:1] + q.values[1:]), None),  # unchanged: reads
    (lambda q: setattr(q, "values", q.values[:2]), "arrays past"),  # protected rows lost
    (lambda q: setattr(q, "values", (q.values[0], q.values[1][..., :9, :], q.values[2])),
     "scale-only"),
    (lambda q: setattr(q, "values", (q.values[0], mx.concatenate([q.values[1]] * 2, -1),
                                     q.values[2])), "scale-only"),
    (lambda q: setattr(q, "keys", (q.keys[0], q.keys[1][..., :2, :], q.keys[2][..., :2, :],
                                   q.keys[3])), "per-channel"),
])
def test_damaged_records_are_misses_never_misread(change, match):
    """Relabelling matters most: a sym layer read as rotated-channel would take its protected
    rows for minimums (and the other way round)."""
    entry = _damaged(change)
    if match is None:
        assert dequantize_entry(entry)[0].offset == N
        return
    with pytest.raises(UnknownCodec, match=match):
        dequantize_entry(entry)


def test_widths_without_a_hadamard_fall_back_to_affine_and_say_so():
    c = KVCache()
    c.update_and_fetch(*(mx.random.normal((1, H, N, 96)).astype(mx.float16) for _ in "kv"))
    q = quantize_entry([c], bits=3, group_size=32, codec=SYM).cache[0]
    assert getattr(q, CODEC_ATTR) == "affine"
    assert codec_name(q) == "affine-k3v3" and len(q.values) == 3
    assert dequantize_entry([q])[0].offset == N
