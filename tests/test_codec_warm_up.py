"""The configured codec (at 8 bits also the one of entries with a window) runs once when the
host has loaded its model (``KVService.learn_model``), not inside the first request that
stores an entry: its kernels' code and numpy's BLAS are loaded before serving, after the
host's load (so not under its peak)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvplugin.cache.codec import quantize
from kvplugin.cache.service.service import KVService
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings


def _service(model, host: str = "test", **flags) -> KVService:
    """A service that has learnt ``model``, as a host's start-up leaves it."""
    from mlx_lm.models.cache import make_prompt_cache

    pm = create_plugin_manager(load_entry_points=False)
    service = KVService(resolve_settings(flags), host=host, hook=pm.hook, max_bytes=1 << 30)
    if host != "none":  # kvplugin info loads no model
        service.learn_model(model, make_prompt_cache(model))
    return service


@pytest.fixture(autouse=True)
def _cold_codec():
    quantize.warm_up.cache_clear()  # once per plan and process: each test starts cold
    yield
    getattr(quantize.warm_up, "cache_clear", lambda: None)()  # a test may stand in for it


@pytest.mark.parametrize("bits,codecs", [(4, ["rotated-channel"]),
                                         (8, ["affine", "rotated-channel"]),  # + windows'
                                         (2, ["rotated-channel-sym"])])
def test_the_configured_codec_round_trips_once_per_dtype_before_serving(monkeypatch, bits,
                                                                       codecs, tiny_llama):
    seen = []
    real_q, real_d = quantize.quantize_entry, quantize.dequantize_entry

    def spy_q(cache, **kw):
        seen.append((cache[0].keys.dtype, kw["codec"], kw["bits"], kw["value_bits"]))
        return real_q(cache, **kw)

    restored = []

    def spy_d(cache, **kw):
        out = real_d(cache, **kw)
        restored.append(type(out[0]).__name__)
        return out

    pm = create_plugin_manager(load_entry_points=False)
    service = KVService(resolve_settings({"kv_cache_quantization": True,
                                          "kv_cache_quantization_bits": bits}),
                        host="test", hook=pm.hook, max_bytes=1 << 30)
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_llama
    monkeypatch.setattr(quantize, "quantize_entry", spy_q)
    monkeypatch.setattr(quantize, "dequantize_entry", spy_d)
    assert seen == []  # not before the host's load
    service.learn_model(model, make_prompt_cache(model))
    service.learn_model(model, make_prompt_cache(model))  # a second load: warm already
    import mlx.core as mx

    assert seen == [(dt, codec, bits, bits) for codec in codecs
                    for dt in (mx.float16, mx.bfloat16, mx.float32)]
    assert restored == ["KVCache"] * 3 * len(codecs)  # quantized, then restored to a plain cache


def test_nothing_is_warmed_without_quantization_or_outside_a_host(monkeypatch, tiny_llama):
    calls = []
    monkeypatch.setattr(quantize, "warm_up", lambda plan: calls.append(plan))
    _service(tiny_llama)
    _service(tiny_llama, host="none", kv_cache_quantization=True)
    assert calls == []
    _service(tiny_llama, kv_cache_quantization=True)
    assert len(calls) == 1


_FIRST_ROUND_TRIP = textwrap.dedent("""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
    from kvplugin.settings import resolve_settings

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1])

    if WARM:
        from kvplugin.cache.codec.quantize import warm_up
        from kvplugin.codecs import codec_plan
        warm_up(codec_plan(resolve_settings({"kv_cache_quantization": True,
                                             "kv_cache_quantization_bits": 4})))
    layer = KVCache()
    x = mx.random.normal((1, 2, 300, 64)).astype(mx.float16)
    layer.update_and_fetch(x, -x)
    mx.eval(layer.keys, layer.values)
    before = rss_kib()
    q = quantize_entry([layer], bits=4, group_size=64, codec="rotated-channel", sink_tokens=4,
                       recent_tokens=16, consume=True).cache
    out = dequantize_entry(q, consume=True)
    mx.eval(out[0].keys)
    print(rss_kib() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_after_the_warm_up_the_first_real_round_trip_loads_almost_nothing():
    """In a fresh process: without the warm-up the first 4-bit round trip of a 300-token
    fp16 entry grew the resident set by ~4 MiB (measured), after it by ~0.15 MiB."""

    def growth(warm: bool) -> int:
        code = f"WARM = {warm}\n" + _FIRST_ROUND_TRIP
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True)
        return int(done.stdout.split()[-1])

    cold, warm = growth(False), growth(True)
    assert cold > 2048 and warm < 1024, (cold, warm)
