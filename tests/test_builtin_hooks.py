"""Each hook, called through the plugin manager as hosts call it, with real MLX caches."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvplugin import plugins
from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.hookspecs import hookimpl
from kvplugin.settings import SettingsError, resolve_settings

from kvcaches import D, H
from kvcaches import filled as filled_cache


@pytest.fixture
def pm():
    return plugins.create_plugin_manager(load_entry_points=False)


def test_configure_is_historic_and_can_stop_startup(pm):
    s = resolve_settings()
    pm.hook.kvplugin_configure.call_historic(kwargs={"settings": s, "host": "mlx-lm"})
    seen = []

    class Late:
        @hookimpl
        def kvplugin_configure(self, settings, host):
            seen.append(host)
            raise SettingsError("late plugin refuses")

    with pytest.raises(SettingsError, match="late plugin refuses"):
        pm.register(Late())
    assert seen == ["mlx-lm"]


def test_make_cache_default_keeps_host_cache(pm):
    cache = [KVCache(), KVCache()]
    assert pm.hook.kvplugin_make_cache(model=None, cache=cache, settings=resolve_settings()) is None


def test_make_cache_bounds_with_max_kv_size(pm):
    s = resolve_settings({"max_kv_size": 128})
    out = pm.hook.kvplugin_make_cache(model=None, cache=[KVCache(), KVCache()], settings=s)
    assert all(isinstance(c, PreallocatedRotatingKVCache) and c.max_size == 128 for c in out)


def test_make_cache_applies_growth_step(pm):
    s = resolve_settings({"kv_cache_step": 1024})
    out = pm.hook.kvplugin_make_cache(model=None, cache=[KVCache()], settings=s)
    out[0].update_and_fetch(*(mx.zeros((1, H, 3, D), dtype=mx.float16),) * 2)
    assert out[0].keys.shape[2] == 1024


def test_trim_entry_releases_slack(pm):
    cache = filled_cache(300)  # 300 tokens in 512 slots
    assert cache[0].keys.shape[2] == 512
    out = pm.hook.kvplugin_trim_entry(cache=cache)
    assert [c.keys.shape[2] for c in out] == [300, 300]
    assert [c.offset for c in out] == [300, 300]


def test_quantize_entry_respects_threshold_and_bits(pm):
    s = resolve_settings({"kv_cache_quantization": True, "kv_cache_quantization_bits": 4,
                          "kv_cache_min_quantize_tokens": 100})
    short = pm.hook.kvplugin_trim_entry(cache=filled_cache(50))
    assert pm.hook.kvplugin_quantize_entry(cache=short, num_tokens=50, settings=s,
                                          prompt_boundaries=(), stored_prefix=None, key_ropes=None) is None
    long = pm.hook.kvplugin_trim_entry(cache=filled_cache(300))
    out = pm.hook.kvplugin_quantize_entry(cache=long, num_tokens=300, settings=s,
                                         prompt_boundaries=(), stored_prefix=None, key_ropes=None)
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 4 for c in out)


def test_dequantize_entry_restores_plain_layers(pm):
    s = resolve_settings({"kv_cache_quantization": True, "kv_cache_min_quantize_tokens": 0})
    entry = pm.hook.kvplugin_trim_entry(cache=filled_cache(300))
    q = pm.hook.kvplugin_quantize_entry(cache=entry, num_tokens=300, settings=s,
                                       prompt_boundaries=(), stored_prefix=None, key_ropes=None)
    out = pm.hook.kvplugin_dequantize_entry(cache=q, settings=s, key_ropes=None)
    assert all(type(c) is KVCache and c.offset == 300 for c in out)
    err = mx.abs(out[0].keys[..., :300, :] - entry[0].keys).max().item()
    assert err < 0.05


def test_store_backend_none_by_default_and_hot_only(pm, tmp_path):
    assert pm.hook.kvplugin_store_backend(settings=resolve_settings()) is None
    hot = resolve_settings({"hot_cache_only": True})
    assert pm.hook.kvplugin_store_backend(settings=hot) is None
    assert not any(tmp_path.iterdir())


def test_store_backend_ssd_when_dir_given(pm, tmp_path):
    from kvplugin.cache.tiers.ssd import SSDTier

    tier = pm.hook.kvplugin_store_backend(settings=resolve_settings({"ssd_cache_dir": tmp_path}))
    assert isinstance(tier, SSDTier)
    tier.close()


def test_on_evict_observed_by_a_plugin(pm):
    from kvplugin.cache.layers import entry_nbytes
    from kvplugin.cache.service.service import KVService

    evicted = []

    class Observer:
        @hookimpl
        def kvplugin_on_evict(self, entry, settings):
            evicted.append(len(entry.tokens))

    pm.register(Observer())
    one = entry_nbytes(pm.hook.kvplugin_trim_entry(cache=filled_cache(40)))
    service = KVService(resolve_settings(), host="test", max_bytes=int(one * 1.5), hook=pm.hook)
    pm.hook.kvplugin_on_evict(entry=type("E", (), {"tokens": (1,)})(), settings=service.settings)
    assert evicted == [1]
    evicted.clear()
    service.insert("m", list(range(40)), filled_cache(40))
    service.insert("m", list(range(100, 140)), filled_cache(40))
    assert evicted == [40]  # the first entry left to make room
    assert service.stats()["store_evictions"] == 1


def test_plugin_override_wins_over_builtin(pm):
    class Mine:
        @hookimpl
        def kvplugin_trim_entry(self, cache):
            return ["mine"]

    pm.register(Mine())
    assert pm.hook.kvplugin_trim_entry(cache=filled_cache(10)) == ["mine"]


def test_unconfigure_is_a_plain_hook_called_by_keyword(pm):
    seen = []

    class Mine:
        @hookimpl
        def kvplugin_unconfigure(self, settings, host):
            seen.append(host)

    pm.register(Mine())
    assert pm.hook.kvplugin_unconfigure(settings=resolve_settings(), host="mlx-lm") == []
    assert seen == ["mlx-lm"]
