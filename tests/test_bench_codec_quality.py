"""``kvplugin bench --quality --real-model`` runs end to end on SmolLM2 and reports, per codec,
the figures docs/benchmarks.md quotes (tiny sizes: a smoke run). Bytes are deterministic:
they are asserted exactly; the quality figures only within their ranges."""

from __future__ import annotations

import json

import pytest

from kvplugin import cli

pytestmark = [pytest.mark.tooling, pytest.mark.real_model]


def test_codec_bench_reports_every_codec(tmp_path, capsys):
    out = tmp_path / "codecs"
    codecs = ["affine-k8v8-g64-s0r0", "rotated-channel-k4v4-g64-s4r16",
              "rotated-channel-sym-k3v3-g64-s4r6"]
    assert cli.main(["bench", "--quality", "--real-model", "--prompts", "1",
                     "--prompt-tokens", "129", "--continuation-tokens", "4",
                     "--codecs", ",".join(codecs), "--out", str(out)]) == 0
    data = json.loads((out / "codecs.json").read_text())
    assert "kvplugin bench --quality --real-model" in data["title"]
    rows = {r["codec"]: r for r in data["rows"]}
    assert list(rows) == codecs
    # 128 tokens in the entry (the last prompt token is fed with the continuation)
    assert rows["affine-k8v8-g64-s0r0"]["bytes_vs_fp16"] == pytest.approx(8 / 16 + 2 / 64)
    # 4-bit codes, scales + minimums per 64 tokens (keys) or 64 channels (values),
    # and 20 protected tokens at full precision besides
    assert rows["rotated-channel-k4v4-g64-s4r16"]["bytes_vs_fp16"] == pytest.approx(
        4 / 16 + 2 / 64 + 20 / 128)
    # 3-bit codes, key scales + minimums per 64 tokens, value scales (no minimum) per 64
    assert rows["rotated-channel-sym-k3v3-g64-s4r6"]["bytes_vs_fp16"] == pytest.approx(
        3 / 16 + 3 / 128 + 10 / 128)
    for r in rows.values():
        assert r["prompts"] == 1 and r["mean_kl"] >= 0 and r["max_kl"] >= r["mean_kl"]
        assert 0 <= r["top1_agreement"] <= 1 and 0 <= r["free_running"] <= 1
        assert r["ms_per_mib"] > 0 and r["prefix_kl"] >= 0
    # a codec without recent rows keeps no rows before the prompt boundary either
    affine = rows["affine-k8v8-g64-s0r0"]
    assert affine["prefix_kl"] == affine["prefix_kl_unprotected"]
    # the plot needs the optional ``bench`` extra (matplotlib); without it the bench says so
    from kvplugin.tools.bench import plots

    if not plots.available():
        assert plots.MISSING_MESSAGE in capsys.readouterr().err
        assert not (out / "codecs-pareto.png").exists()
    else:
        assert (out / "codecs-pareto.png").stat().st_size > 0


@pytest.mark.parametrize("family,max_kv", [(None, None), ("mamba", None),
                                            ("gemma3_text", None), (None, 64)])
def test_codec_bench_runs_on_any_model_directory(family, max_kv, tmp_path):
    """``--model DIR``: the same bench on any mlx-lm model (here offline random-weight ones:
    only the deterministic bytes are asserted), ``--max-kv-size`` bounding every layer.
    Where the entry cannot be cut back (recurrent state, a wrapped window) the prefix-cut
    columns are empty and the note says why."""
    from kvplugin.tools.models.families import build_family_model
    from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

    model = build_kv_heavy_model() if family is None else build_family_model(family)
    out = tmp_path / "codecs"
    argv = ["bench", "--quality", "--real-model", "--model", str(model), "--prompts", "1",
            "--prompt-tokens", "129", "--continuation-tokens", "4",
            "--codecs", "affine-k8v8-g64-s0r0", "--out", str(out)]
    if max_kv:
        argv += ["--max-kv-size", str(max_kv)]
    assert cli.main(argv) == 0
    data = json.loads((out / "codecs.json").read_text())
    assert data["title"].startswith(f"{model.name} (")
    assert ", 1 real-text window" in data["title"]
    (row,) = data["rows"]
    assert row["codec"] == "affine-k8v8-g64-s0r0"
    # a window or recurrent state: 8 bits there are rotated-channel by default
    windowed = family in ("gemma3_text", "mamba") or max_kv
    assert row["ranked_key_bits"] is None
    assert (row["key_bits"], row["value_bits"], row["default_for_bits"]) == (
        8, 8, None if windowed else 8)
    assert 0 <= row["free_running"] <= 1 and row["restore_ms_per_mib"] > 0
    if family == "mamba":  # nothing but recurrent state: stored as it is (its own codec aside)
        assert data["note"] == "prefix_kl columns empty: recurrent state cannot be cut back"
        assert row["prefix_kl"] is None
    elif family == "gemma3_text" or max_kv:  # windows of 128 / 64 tokens: wrapped
        assert data["note"] == "prefix_kl columns empty: a wrapped window cannot be cut back"
        assert row["prefix_kl"] is None and row["bytes_vs_fp16"] < 0.6
    else:
        assert data["note"] is None and row["prefix_kl"] >= 0
        assert row["bytes_vs_fp16"] == pytest.approx(8 / 16 + 2 / 64)


def test_the_default_codecs_are_what_the_settings_resolve():
    """``--codecs defaults`` (the default) names the codec each bit width resolves to."""
    from kvplugin.codecs import codec_plan
    from kvplugin.settings import resolve_settings
    from kvplugin.tools.bench.codec_quality import default_codecs

    got = default_codecs()
    assert sorted(got.values()) == [3, 4, 8]
    for spec, bits in got.items():
        plan = codec_plan(resolve_settings({"kv_cache_quantization_bits": bits}))
        assert spec == (f"{plan.codec}-k{plan.key_bits}v{plan.value_bits}-g{plan.group_size}"
                        f"-s{plan.sink_tokens}r{plan.recent_tokens}"
                        f"{'+prerope-served' if plan.prerope_keys else ''}")


def test_pre_rope_keys_follow_each_slot_of_a_wrapped_ring():
    """``+prerope``: a ring's slots hold positions out of order; undoing RoPE at each slot's
    position and redoing it gives the keys back, and a key computed at position p comes out
    as the unrotated key."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    from kvplugin.cache.codec.prerope import ring_runs, turn
    from kvplugin.cache.model.rope import KeyRope

    ring, raw = RotatingKVCache(8, 2), []
    rope = KeyRope(16, False, 10000.0, 1.0)
    for p in range(21):  # one token at a time: wraps in place
        k = mx.random.normal((1, 1, 1, 16), key=mx.random.key(p))
        raw.append(k)
        turned = mx.fast.rope(k, 16, traditional=False, base=10000.0, scale=1.0, offset=p)
        ring.update_and_fetch(turned, turned)
    runs = ring_runs(ring.offset, ring.keys.shape[-2], ring.keep, ring._idx)
    positions = [p + i for _, n, p in runs for i in range(n)]
    assert sorted(positions) == [0, 1] + list(range(15, 21))
    assert positions[ring._idx - 1] == 20
    unrotated = turn(ring.keys, rope, runs, -1.0)
    for slot, p in enumerate(positions):
        assert mx.allclose(unrotated[..., slot, :], raw[p][..., 0, :], atol=1e-5)
    assert mx.allclose(turn(unrotated, rope, runs, 1.0), ring.keys, atol=1e-5)


def test_the_default_codecs_of_a_windowed_wide_head_model_follow_the_per_layer_rule():
    """On heads of 256 with a window (Gemma 3) the bench measures what a server stores there:
    rotated-channel at 8 bits, k5v4 (the worst-quantized layers' keys at 6 bits) and k4v2 in
    groups of 128; without a window, the plain defaults."""
    from kvplugin.tools.bench.codec_quality import default_codecs

    wide = default_codecs((256, 256), windowed=True)
    assert wide == {"rotated-channel-k8v8-g64-s0r0": 8,
                    "rotated-channel-k5v4-g128-s4r16-kr6+prerope-served": 4,
                    "rotated-channel-sym-k4v2-g128-s4r6": 3}
    assert default_codecs((256, 256), windowed=False) == default_codecs()
    assert "rotated-channel-k4v4-g64-s4r16+prerope-served" in default_codecs()
