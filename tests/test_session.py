"""The session owns every policy; each hook fires through the session the hosts call.

The direct calls of each hook are in test_builtin_hooks.py; these go through
``KVService`` (what both host adapters call at their seams), with real mlx-lm caches.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvplugin import plugins
from kvplugin.cache.codec.lanes import lane_count
from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.service.startup_checks import host_option_conflict, model_problem
from kvplugin.cache.service.service import KVService
from kvplugin.codecs import codec_plan
from kvplugin.hookspecs import hookimpl
from kvplugin.settings import SettingsError, resolve_settings

from kvcaches import D, H, filled


class Recorder:
    """Records every hook call (name, host-visible arguments) and declines each one."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @hookimpl
    def kvplugin_configure(self, settings, host):
        self.calls.append(("configure", host))

    @hookimpl
    def kvplugin_unconfigure(self, settings, host):
        self.calls.append(("unconfigure", host))

    @hookimpl
    def kvplugin_make_cache(self, model, cache, settings):
        self.calls.append(("make_cache", len(cache)))

    @hookimpl
    def kvplugin_trim_entry(self, cache):
        self.calls.append(("trim", len(cache)))

    @hookimpl
    def kvplugin_quantize_entry(self, cache, num_tokens, settings):
        self.calls.append(("quantize", num_tokens))

    @hookimpl
    def kvplugin_dequantize_entry(self, cache, settings):
        self.calls.append(("dequantize", len(cache)))

    @hookimpl
    def kvplugin_store_backend(self, settings):
        self.calls.append(("store_backend", settings.ssd_cache_dir))

    @hookimpl
    def kvplugin_on_evict(self, entry, settings):
        self.calls.append(("on_evict", len(entry.tokens)))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def pm():
    return plugins.create_plugin_manager(load_entry_points=False)


@pytest.fixture
def rec(pm):
    r = Recorder()
    pm.register(r)
    return r


def session(pm, **flags) -> KVService:
    return KVService(resolve_settings(flags), host="test", hook=pm.hook, max_bytes=1 << 40)


# -- every hook, fired through the session -----------------------------------------------


def test_configure_and_store_backend_fire_when_the_session_is_built(pm, rec):
    session(pm)
    assert rec.calls == [("configure", "test"), ("store_backend", None)]


def test_make_cache_fires_and_its_result_is_used(pm, rec):
    out = session(pm, max_kv_size=64).make_cache(None, [KVCache(), KVCache()])
    assert ("make_cache", 2) in rec.calls
    assert all(isinstance(c, PreallocatedRotatingKVCache) and c.max_size == 64 for c in out)


def test_trim_and_quantize_fire_on_insert_and_dequantize_on_fetch(pm, rec):
    s = session(pm, kv_cache_quantization=True, kv_cache_min_quantize_tokens=0)
    assert s.insert("m", list(range(40)), filled(40))
    assert rec.names()[-2:] == ["trim", "quantize"] and rec.calls[-1] == ("quantize", 40)
    assert isinstance(s.store.entries()[0].cache[0], QuantizedKVCache)  # the default answered
    cache, n = s.fetch("m", list(range(40)) + [7])
    assert n == 40 and rec.calls[-1] == ("dequantize", 2)
    assert type(cache[0]) is KVCache


def _peak_rise(work) -> int:
    """How far MLX's active memory rose above its level before ``work()`` (bytes)."""
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    work()
    return mx.get_peak_memory() - before


def test_a_reused_quantized_entry_is_lent_as_stored_and_its_rows_copied_by_the_next_insert(
        pm, monkeypatch):
    """A fetch peaks at the restored copy plus one layer's codec work, not at a second copy:
    the store lends the quantized layers it held (no bytes copied). They serve a concurrent
    request of this thread, and the turn's own insert copies their rows, quantizing only the
    tokens the turn added, after which they go."""
    from kvplugin.cache.codec import rotation

    s = session(pm, kv_cache_quantization=True, kv_cache_quantization_bits=4,
                kv_cache_min_quantize_tokens=0)
    layers, tokens = 16, 512
    gc.collect()
    base = mx.get_active_memory()
    assert s.insert("m", list(range(tokens)), filled(tokens, layers))
    stored = s.store.entries()[0].nbytes
    full = layers * 2 * H * tokens * D * 2  # fp16 keys and values
    assert stored < 0.35 * full  # 4-bit codes and their scales, 20 protected rows
    plan = codec_plan(s.settings)  # one layer's restore work, with the codec stored
    one_layer = _peak_rise(lambda: dequantize_entry(quantize_entry(
        filled(tokens, 1), bits=4, group_size=64, codec=plan.codec).cache, consume=True))
    cache, n = None, 0

    def fetch():
        nonlocal cache, n
        cache, n = s.fetch("m", list(range(tokens)) + [7])

    rise = _peak_rise(fetch)
    assert n == tokens and all(type(c) is KVCache for c in cache)
    # the restored copy is new memory, beside the layers in flight (kvplugin.cache.codec.lanes)
    assert rise <= full + lane_count() * one_layer, (rise, full, one_layer)
    # the lent layers serve a concurrent request of this thread, restored to full precision
    again, m = s.fetch("m", list(range(tokens)) + [8])
    assert m == tokens and all(type(c) is KVCache for c in again)
    assert s.store.stats().lent_copies == 1
    assert mx.array_equal(again[3].keys[..., :tokens, :], cache[3].keys[..., :tokens, :])
    del again
    rotated: list[int] = []
    real = rotation.rotate
    monkeypatch.setattr(rotation, "rotate", lambda x, *a: rotated.append(x.shape[-2]) or real(x, *a))
    for layer in cache:  # the turn: 8 more tokens
        k = mx.random.normal((1, H, 8, D)).astype(mx.float16)
        layer.update_and_fetch(k, k)
    del layer, k
    assert s.insert("m", list(range(tokens)) + [7] * 8, cache)
    assert rotated == [8, 8] * layers  # keys (whole groups held) and values: the new rows
    del cache
    gc.collect()
    # the host's copy and the lent entry went: what is left is the new entry
    assert s.store.stats().entries == 1 and s.store.nbytes > stored
    assert mx.get_active_memory() - base <= s.store.nbytes + (64 << 10)  # (MLX scalars)


def test_an_entry_that_shares_a_stored_entrys_first_tokens_copies_their_rows(pm, monkeypatch):
    """Not only a stored *prefix*: a conversation's next turn usually shares its previous
    entry only up to where the reply was tokenized anew. The rows of the shared tokens are
    copied (views of the stored entry, cut there), the rest quantized."""
    from kvplugin.cache.codec import rotation

    s = session(pm, kv_cache_quantization=True, kv_cache_quantization_bits=4,
                kv_cache_min_quantize_tokens=0)
    shared, layers = 512, 4
    first = filled(shared + 40, layers)
    assert s.insert("m", list(range(shared)) + [1] * 40, first)
    rotated: list[int] = []
    real = rotation.rotate
    monkeypatch.setattr(rotation, "rotate", lambda x, *a: rotated.append(x.shape[-2]) or real(x, *a))
    assert s.insert("m", list(range(shared)) + [2] * 24, filled(shared + 24, layers))
    assert rotated == [24, 24] * layers  # keys (512 is whole groups) and values
    assert len(s.store) == 2  # the other branch stays stored, untouched
    (old,) = [e for e in s.store.entries() if e.tokens[-1] == 1]
    assert old.cache[0].offset == shared + 40


def test_the_next_turn_of_a_reused_entry_is_quantized_layer_by_layer(pm):
    """Storing a conversation's next turn frees each full-precision layer as its quantized
    copy is made: the snapshot lent at the fetch (the live layers themselves) is settled
    first, not after the whole new entry exists beside the old one."""
    s = session(pm, kv_cache_quantization=True, kv_cache_quantization_bits=8,
                kv_cache_min_quantize_tokens=0)
    layers, tokens = 16, 512
    assert s.insert("m", list(range(tokens)), filled(tokens, layers))
    cache, n = s.fetch("m", list(range(tokens + 16)))
    for layer in cache:  # the host runs the next turn: 16 more tokens
        k = mx.zeros((1, H, 16, D), dtype=mx.float16)
        layer.update_and_fetch(k, k)
    mx.eval([c.keys for c in cache])
    codec = codec_plan(s.settings).codec
    one_layer = _peak_rise(lambda: quantize_entry(filled(tokens + 16, 1), bits=8,
                                                  group_size=64, codec=codec, consume=True))
    rise = _peak_rise(lambda: s.insert("m", list(range(tokens + 16)), cache))
    stored = s.store.entries()[0].nbytes
    assert len(s.store) == 1 and s.store.entries()[0].tokens == tuple(range(tokens + 16))
    assert rise <= one_layer + 2 * stored // layers, (rise, stored, one_layer)


def test_on_evict_fires_when_the_budget_evicts(pm, rec):
    s = KVService(resolve_settings(), host="test", hook=pm.hook, max_entries=1)
    s.insert("m", list(range(10)), filled(10))
    s.insert("m", list(range(100, 120)), filled(20))
    assert ("on_evict", 10) in rec.calls


def test_unconfigure_fires_at_close_after_the_store_is_closed(pm, rec, tmp_path):
    closed = []

    class Tier:
        def put(self, model_key, tokens, cache):
            return True

        def fetch(self, model_key, tokens):
            return None

        def close(self):
            closed.append(list(rec.names()))

    class Backend:
        @hookimpl
        def kvplugin_store_backend(self, settings):
            return Tier()

    pm.register(Backend())
    s = session(pm)
    s.close()
    s.close()  # once
    assert closed == [["configure"]]  # closed (the later plugin answered) before unconfigure
    assert rec.names()[-1] == "unconfigure" and rec.names().count("unconfigure") == 1


# -- policies -----------------------------------------------------------------------------


def test_configure_fires_once_per_relay(pm, rec):
    a, b = session(pm), session(pm)
    assert rec.names().count("configure") == 1
    b.close()  # the session that did not configure does not unconfigure either
    assert "unconfigure" not in rec.names()
    a.close()
    assert rec.names().count("unconfigure") == 1


def test_plugin_settings_error_in_configure_propagates(pm):
    class Refuse:
        @hookimpl
        def kvplugin_configure(self, settings, host):
            raise SettingsError("refused")

    pm.register(Refuse())
    with pytest.raises(SettingsError, match="refused"):
        session(pm)


def test_hot_cache_only_never_asks_the_backend(pm, rec, tmp_path):
    s = session(pm, hot_cache_only=True)
    assert "store_backend" not in rec.names()
    assert s.store.cold is None
    s.insert("m", list(range(10)), filled(10))
    assert s.persist(tmp_path / "p") is False and s.reload(tmp_path) == 0
    assert "store_backend" not in rec.names() and not any(tmp_path.iterdir())


def test_persistence_goes_through_the_backend_hook(pm, rec, tmp_path):
    directory = tmp_path / "persist"
    s = session(pm)
    assert s.store.cold is None
    s.insert("m", list(range(30)), filled(30))
    assert s.persist(directory) is True
    assert ("store_backend", directory) in rec.calls  # the default storage plugin answered
    s.close()
    again = session(pm)
    assert again.reload(directory) == 1
    cache, n = again.fetch("m", list(range(30)) + [5])
    assert n == 30 and cache[0].offset == 30


def test_persistence_tier_refuses_puts_while_serving(pm, tmp_path):
    directory = tmp_path / "persist"
    directory.mkdir()
    s = KVService(resolve_settings(), host="test", hook=pm.hook, max_entries=1)
    assert s.reload(directory) == 0  # attached, empty
    s.insert("m", list(range(10)), filled(10))
    s.insert("m", list(range(100, 110)), filled(10))  # evicts the first: discarded
    assert s.stats()["store_discarded"] == 1 and s.stats()["store_spills"] == 0
    assert s.persist(directory) is True and s.stats()["store_spills"] == 1


def test_batch_plan():
    pm = plugins.create_plugin_manager(load_entry_points=False)
    plain = session(pm).batch_plan()
    assert plain.steps == {} and plain.bound is None
    plan = session(pm, kv_cache_step=512, max_kv_size=128).batch_plan()
    assert plan.steps == {"BatchKVCache": 512, "BatchRotatingKVCache": 128}
    assert plan.bound == 128
    assert session(pm, kv_cache_step=64).batch_plan().bound is None


def test_make_cache_says_once_per_model_which_layers_it_cannot_reach(pm, capsys):
    from types import SimpleNamespace

    from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache

    from kvplugin import log

    log.forget()
    bounded, model = session(pm, max_kv_size=16), SimpleNamespace()
    out = bounded.make_cache(model, [ChunkedKVCache(8), RotatingKVCache(16)])
    assert type(out[1]) is PreallocatedRotatingKVCache
    err = capsys.readouterr().err
    assert "--max-kv-size 16: 1 of 2 cache layers" in err and "ChunkedKVCache x1" in err
    bounded.make_cache(model, [ChunkedKVCache(8)])
    assert capsys.readouterr().err == ""  # once per model
    bounded.make_cache(SimpleNamespace(), [KVCache(), KVCache()])
    assert capsys.readouterr().err == ""  # every layer bounded: nothing to say
    session(pm, kv_cache_step=64).make_cache(model, [ChunkedKVCache(8), KVCache()])
    err = capsys.readouterr().err
    assert "--kv-cache-step 64 applies to KVCache layers only; ChunkedKVCache layers" in err


def test_the_front_desk_answers_for_the_store_and_admission(pm):
    s = KVService(resolve_settings({"max_memory": "off"}), host="test", hook=pm.hook,
                  max_bytes=1 << 30)
    assert (s.entries_held, s.bytes_held, s.budget_bytes) == (0, 0, 1 << 30)
    for i in range(3):
        assert s.give_back("m", [100 + i] + list(range(15)), filled(16))
    assert s.entries_held == 3 and s.bytes_held == s.store_stats().bytes > 0
    s.trim_to(n_entries=1)
    assert s.entries_held == 1 and s.store_stats().evictions == 2
    s.drop_all()
    assert (s.entries_held, s.bytes_held) == (0, 0)
    assert not s.admission_on
    assert s.admit(1, None, prompt_tokens=10, max_tokens=1, prefill_chunk=8) is None
    assert session(pm, max_memory="auto").admission_on
    assert s.live_quantization is None
    s.learn_live_quantization(8, 32, 0)
    assert s.live_quantization == (8, 32, 0)


def test_host_option_conflicts():
    bounded = resolve_settings({"max_kv_size": 64})
    assert "--kv-bits" in host_option_conflict(bounded, {"kv_bits": 8})
    assert "--draft-model" in host_option_conflict(bounded, {"draft_model": "x"})
    assert host_option_conflict(bounded, {}) is None
    assert host_option_conflict(resolve_settings(), {"kv_bits": 8}) is None
    # changed on purpose: vllm-mlx's batching mode keeps the first tokens now (keep_batch)
    assert host_option_conflict(bounded, {"continuous_batching": True}) is None


def test_model_problem_is_one_message_naming_flag_env_and_source():
    model = {"args": {"hidden_size": 256, "num_attention_heads": 4}}  # head dim 64
    s = resolve_settings({"kv_cache_quantization": True,
                          "kv_cache_quantization_group_size": 128})
    msg = model_problem(model, s, {"kv_cache_quantization_group_size"})
    assert "got --kv-cache-quantization-group-size 128" in msg
    assert "KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE" in msg
    assert "the default 128" in model_problem(model, s)
    assert model_problem(model, resolve_settings({"kv_cache_quantization": True})) is None


def test_active_line_says_what_is_on(pm):
    s = KVService(resolve_settings({"kv_cache_quantization": True, "max_kv_size": 256}),
                  host="mlx-lm", hook=pm.hook, max_bytes=64 << 20, max_entries=5)
    line = s.active_line("1.2.3", stats_path="/kvplugin/stats", mode="batching")
    assert line.startswith("active on mlx-lm 1.2.3 (batching)")
    assert "64 MiB, 5 entries" in line and "8-bit entries, group 64" in line
    assert ("codec affine-k8v8 (rotated-channel in entries with a window or recurrent state), "
            "policy always;"
            in line)  # what auto chose, and when it runs
    assert "max-kv-size: 256 tokens" in line and "GET /kvplugin/stats" in line


def test_a_named_codec_the_model_cannot_take_is_refused_naming_flag_and_env():
    """Head dimension 96 (no Hadamard): ``rotated-channel`` named by the user is refused at
    start-up, not stored as ``affine``; ``auto`` falls back silently, ``affine`` fits."""
    model = {"args": {"hidden_size": 384, "num_attention_heads": 4}}  # head dim 96
    named = resolve_settings({"kv_cache_quantization": True, "kv_cache_codec": "rotated-channel",
                              "kv_cache_quantization_group_size": 32})
    msg = model_problem(model, named, {"kv_cache_codec"})
    assert "got --kv-cache-codec rotated-channel" in msg and "KVPLUGIN_KV_CACHE_CODEC" in msg
    assert "can only take affine" in msg
    for codec in ("auto", "affine"):
        fits = resolve_settings({"kv_cache_quantization": True, "kv_cache_codec": codec,
                                 "kv_cache_quantization_group_size": 32})
        assert model_problem(model, fits, {"kv_cache_codec"}) is None
