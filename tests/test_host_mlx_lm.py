"""The mlx-lm adapter's pure pieces, in-process (no server): install/uninstall identity, the
parser hook, the prompt-cache replacement over a real KVService, the cache-construction
wrapper, the model fingerprint and the start-up group-size check."""

from __future__ import annotations

import argparse
import importlib
import json
import types

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.service.service import KVService
from kvplugin import plugins
from kvplugin.hosts.base import shaping_make_prompt_cache
from kvplugin.hosts import mlx_lm as host
from kvplugin.hosts.mlx_lm.adapter import _StartupError
from kvplugin.settings import resolve_settings

mlx_lm_server = importlib.import_module("mlx_lm.server")
cache_mod = importlib.import_module("mlx_lm.models.cache")
gen_mod = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is a function)

H, D = 2, 64  # the caches below: 2 KV heads x 64, fp16 -> 256 bytes per token per K or V
TOKEN_BYTES = 2 * 2 * H * D * 2  # 2 layers x (K, V) x H x D x fp16


def _seams() -> dict:
    """Every attribute the adapter replaces, as stored on its owner (identity)."""
    out = {
        ("server", "main"): vars(mlx_lm_server)["main"],
        ("server", "run"): vars(mlx_lm_server)["run"],
        ("server", "LRUPromptCache"): vars(mlx_lm_server)["LRUPromptCache"],
        ("server", "make_prompt_cache"): vars(mlx_lm_server)["make_prompt_cache"],
        ("cache", "make_prompt_cache"): vars(cache_mod)["make_prompt_cache"],
        ("ModelProvider", "_load"): vars(mlx_lm_server.ModelProvider)["_load"],
        ("ModelProvider", "load_default"): vars(mlx_lm_server.ModelProvider)["load_default"],
        ("APIHandler", "do_GET"): vars(mlx_lm_server.APIHandler)["do_GET"],
        ("BatchKVCache", "step"): vars(cache_mod.BatchKVCache)["step"],
        ("BatchRotatingKVCache", "step"): vars(cache_mod.BatchRotatingKVCache)["step"],
    }
    if "make_prompt_cache" in vars(gen_mod):  # 0.32.x copies it into mlx_lm.generate
        out[("generate", "make_prompt_cache")] = vars(gen_mod)["make_prompt_cache"]
    return out


@pytest.fixture(scope="module", autouse=True)
def _global_adapter_off():
    """The bootstrap may have installed the global adapter when mlx_lm.server was imported."""
    was = host.ADAPTER.installed
    host.ADAPTER.uninstall()
    yield
    if was:
        host.ADAPTER.install(mlx_lm_server)


@pytest.fixture
def adapter():
    a = host.MlxLmAdapter()
    yield a
    a.uninstall()


def _settings(**flags):
    return resolve_settings(flags)


def _kv_layer(n: int, seed: int = 0) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed)).astype(mx.float16)
    c.update_and_fetch(k, k + 1)
    return c


def _entry(n: int, seed: int = 0) -> list:
    return [_kv_layer(n, seed), _kv_layer(n, seed + 1)]


def _tiny_llama():
    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 32, "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    })
    return llama.Model(args)


# --------------------------------------------------------------------------- install


def test_supported_range():
    assert str(host.MlxLmAdapter.supported) in (">=0.31.3,<0.33", "<0.33,>=0.31.3")
    assert host.ADAPTER.support_problem() is None  # the installed mlx-lm is in range


def test_install_patches_every_seam_and_uninstall_restores_identity(adapter):
    before = _seams()
    assert adapter.install(mlx_lm_server) is True
    patched = _seams()
    for key, original in before.items():
        if key[1] == "step":
            continue  # class steps change only when a service starts with step settings
        assert patched[key] is not original, key
    assert mlx_lm_server.LRUPromptCache is host.KVPluginPromptCache
    wrapped = mlx_lm_server.make_prompt_cache
    assert cache_mod.make_prompt_cache is wrapped
    assert getattr(gen_mod, "make_prompt_cache", wrapped) is wrapped
    assert wrapped.__kvplugin_original__ is before[("cache", "make_prompt_cache")]
    adapter.uninstall()
    after = _seams()
    for key, original in before.items():
        assert after[key] is original, key
    assert not hasattr(gen_mod, "make_prompt_cache") or (
        gen_mod.make_prompt_cache is cache_mod.make_prompt_cache
    )


def test_every_patch_is_marked_with_its_original(adapter):
    from patches import unmarked

    assert adapter.install(mlx_lm_server)
    adapter.settings = _settings(kv_cache_step=1024, max_kv_size=4096)
    adapter.create_service(max_bytes=None, max_entries=None)
    assert len(adapter.registry) > 20 and unmarked(adapter.registry) == []


def test_unsupported_version_runs_stock(adapter, monkeypatch, capsys):
    from packaging.version import Version

    from kvplugin import log

    log.forget()
    monkeypatch.setattr(adapter, "version", lambda: Version("0.30.7"))
    before = _seams()
    assert adapter.install(mlx_lm_server) is False
    assert _seams() == before and len(adapter.registry) == 0
    err = capsys.readouterr().err
    assert "mlx-lm 0.30.7 is outside kvplugin's supported range" in err and "runs stock" in err


def test_install_is_all_or_nothing_on_a_foreign_module(adapter):
    fake = types.ModuleType("mlx_lm.server")
    fake.main = lambda: None  # no run, no LRUPromptCache, ...
    before = _seams()
    assert adapter.install(fake) is False
    assert len(adapter.registry) == 0
    assert _seams() == before


def test_batch_steps_follow_the_settings_and_are_restored(adapter, monkeypatch):
    before = _seams()
    adapter.install(mlx_lm_server)
    adapter.settings = _settings(kv_cache_step=1024, max_kv_size=4096)
    adapter.create_service(max_bytes=None, max_entries=None)
    assert cache_mod.BatchKVCache.step == 1024
    assert cache_mod.BatchRotatingKVCache.step == 4096
    adapter.uninstall()
    assert _seams() == before
    assert cache_mod.BatchKVCache.step == 256 == cache_mod.BatchRotatingKVCache.step


# --------------------------------------------------------------------------- options


def _fake_main(argv):
    def main():
        parser = argparse.ArgumentParser(prog="mlx_lm.server")
        parser.add_argument("--model")
        parser.add_argument("--kv-bits", type=int, default=None)
        parser.add_argument("--draft-model", default=None)
        ns = parser.parse_args(argv)
        other = argparse.ArgumentParser().parse_args([])  # a second parser is left alone
        return ns, other

    return main


def test_wrapped_main_adds_options_and_resolves_settings(adapter, monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION", "1")
    raw = vars(argparse.ArgumentParser)["parse_args"]
    main = adapter._wrap_main(_fake_main(["--model", "m", "--max-kv-size", "8"]))
    ns, other = main()
    assert vars(argparse.ArgumentParser)["parse_args"] is raw  # restored
    assert ns.model == "m" and ns.max_kv_size == 8 and ns.kv_cache_quantization is True
    assert vars(other) == {}
    assert adapter.settings.max_kv_size == 8 and adapter.settings.kv_cache_quantization
    assert adapter.given_flags == {"max_kv_size": 8}  # the env value is not a flag


def test_wrapped_main_help_lists_options(adapter, capsys):
    main = adapter._wrap_main(_fake_main(["--help"]))
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--kv-cache-quantization-bits" in out and "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS" in out
    assert vars(argparse.ArgumentParser)["parse_args"].__module__ == "argparse"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kv-cache-quantization-bits", "7"], ["--kv-cache-quantization-bits",
                                                 "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS"]),
        (["--max-kv-size", "64", "--kv-bits", "8"], ["--max-kv-size", "--kv-bits"]),
        (["--max-kv-size", "64", "--draft-model", "d"], ["--max-kv-size", "--draft-model"]),
    ],
)
def test_wrapped_main_rejects_bad_values(adapter, capsys, argv, words):
    main = adapter._wrap_main(_fake_main(argv))
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err
    assert vars(argparse.ArgumentParser)["parse_args"].__module__ == "argparse"


# --------------------------------------------------------------------------- prompt cache


@pytest.fixture
def service():
    return KVService(_settings(), host="mlx-lm", hook=plugins.get_plugin_manager().hook,
                     max_bytes=100 * TOKEN_BYTES, max_entries=10)


def test_prompt_cache_insert_fetch_moves_and_leaves_one_token(service):
    pc = host.KVPluginPromptCache(service=service)
    model = ("/nonexistent/model", None, None)
    tokens = list(range(10, 50))
    live = _entry(40)
    live[0].keys = mx.concatenate([live[0].keys, mx.zeros_like(live[0].keys)], axis=2)  # slack
    pc.insert_cache(model, tokens, live, cache_type="system")
    assert len(pc) == 1 and pc.nbytes == 40 * TOKEN_BYTES  # trimmed before storage
    assert pc.stats_by_type() == {"kvplugin": {"n_sequences": 1, "n_bytes": pc.nbytes}}

    cache, rest = pc.fetch_nearest_cache(model, tokens + [7, 8])  # longer request: move
    assert rest == [7, 8] and [c.offset for c in cache] == [40, 40]
    assert len(pc) == 0  # moved out, not copied

    pc.insert_cache(model, tokens, cache)
    cache, rest = pc.fetch_nearest_cache(model, tokens)  # exact: one token left to process
    assert rest == tokens[-1:] and cache[0].offset == 39

    assert pc.fetch_nearest_cache(("other", None, None), tokens) == (None, tokens)


def test_prompt_cache_budget_and_trim_to(service):
    pc = host.KVPluginPromptCache(service=service)
    model = ("m", None, None)
    for i in range(4):  # 4 x 30 tokens > 100 tokens of budget
        pc.insert_cache(model, [i] * 30, _entry(30, seed=i))
        assert pc.nbytes <= 100 * TOKEN_BYTES
    assert len(pc) == 3
    pc.trim_to(n_sequences=1)
    assert len(pc) == 1
    pc.trim_to(n_bytes=0)
    assert len(pc) == 0 and pc.nbytes == 0


def test_prompt_cache_report_lists_entries(service):
    pc = host.KVPluginPromptCache(service=service)
    pc.insert_cache(("m", None, None), list(range(12)), _entry(12))
    report = json.loads(json.dumps(pc.report(), default=str))
    assert report["host"] == "mlx-lm" and report["store_entries"] == 1
    assert report["max_bytes"] == 100 * TOKEN_BYTES and report["max_entries"] == 10
    (e,) = report["entries"]
    assert e["tokens"] == 12 and e["nbytes"] == 12 * TOKEN_BYTES == e["dense_nbytes"]
    assert e["layers"] == ["KVCache", "KVCache"] and e["bits"] == [None, None]


def test_quantized_entry_is_described_with_bits():
    from kvplugin.cache.codec.quantize import quantize_entry
    from kvplugin.cache.service.report import describe_entry

    q = quantize_entry(_entry(64), bits=8, group_size=64).cache
    e = describe_entry("m", list(range(64)), q, sum(c.nbytes for c in q))
    assert e["bits"] == [8, 8] and e["layers"] == ["QuantizedKVCache"] * 2
    assert e["dense_nbytes"] == 64 * TOKEN_BYTES
    assert e["nbytes"] <= 0.532 * e["dense_nbytes"] and e["full_precision_tokens"] == 0
    q = quantize_entry(_entry(64), bits=4, group_size=64, codec="rotated-channel",
                       sink_tokens=4, recent_tokens=8, prompt_boundaries=(30,)).cache
    e = describe_entry("m", list(range(64)), q, sum(c.nbytes for c in q))
    assert e["full_precision_tokens"] == 4 + 8 + 8


def test_prompt_cache_survives_store_errors(service, monkeypatch):
    pc = host.KVPluginPromptCache(service=service)

    def boom(*a, **k):
        raise RuntimeError("broken")

    monkeypatch.setattr(service, "fetch", boom)
    monkeypatch.setattr(service, "insert", boom)
    assert pc.fetch_nearest_cache("m", [1, 2, 3]) == (None, [1, 2, 3])
    pc.insert_cache("m", [1, 2, 3], _entry(3))  # dropped, no exception


def test_key_for_cache_aligns_key_and_cache():
    key_for_cache = KVService.key_for_cache  # moved from kvplugin.cache.layers.trim

    tokens = list(range(20))
    assert key_for_cache(_entry(20), tokens) == tokens
    assert key_for_cache(_entry(15), tokens) == tokens[:15]  # key cut to the cache
    longer = _entry(25)
    assert key_for_cache(longer, tokens) == tokens and longer[0].offset == 20
    assert key_for_cache([KVCache(), KVCache()], tokens) is None


# --------------------------------------------------------------------------- cache construction


def test_make_prompt_cache_wrapper(adapter):
    model = _tiny_llama()
    original = cache_mod.make_prompt_cache
    wrapped = shaping_make_prompt_cache(adapter, original, "test")
    assert [type(c) for c in wrapped(model)] == [KVCache, KVCache]  # no service: stock
    adapter._cache_mod = cache_mod
    adapter.settings = _settings(max_kv_size=32)
    service = adapter.create_service(max_bytes=None, max_entries=None)
    bounded = wrapped(model)
    assert [type(c) for c in bounded] == [PreallocatedRotatingKVCache] * 2
    assert all(c.max_size == 32 for c in bounded)
    assert service.counters.caches_bounded == 1
    assert all(isinstance(c, RotatingKVCache) for c in bounded)  # mergeable: still batchable


def test_the_service_says_which_layers_cannot_be_bounded(adapter, capsys):
    from kvplugin import log

    log.forget()
    model = types.SimpleNamespace()
    wrapped = shaping_make_prompt_cache(
        adapter, lambda model: [cache_mod.ChunkedKVCache(8), RotatingKVCache(16)], "test")
    adapter._cache_mod = cache_mod
    adapter.settings = _settings(max_kv_size=16)
    adapter.create_service(max_bytes=None, max_entries=None)
    capsys.readouterr()
    wrapped(model)
    err = capsys.readouterr().err
    assert "--max-kv-size 16: 1 of 2 cache layers" in err and "ChunkedKVCache x1" in err
    wrapped(model)
    assert capsys.readouterr().err == ""  # once per model


# --------------------------------------------------------------------------- start-up check


def test_group_size_problem_names_flag_and_env(adapter, monkeypatch):
    model = _tiny_llama()  # head_dim 64
    adapter.settings = _settings(kv_cache_quantization=True, kv_cache_quantization_group_size=128)
    adapter.given_flags = {"kv_cache_quantization_group_size": 128}
    msg = adapter._group_size_problem(model)
    assert "--kv-cache-quantization-group-size" in msg
    assert "KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE" in msg and "head dimension 64" in msg
    assert "got --kv-cache-quantization-group-size 128" in msg
    adapter.given_flags = {}
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE", "128")
    assert "got KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE=128" in adapter._group_size_problem(model)
    adapter.settings = _settings(kv_cache_quantization=True, kv_cache_quantization_group_size=64)
    assert adapter._group_size_problem(model) is None
    adapter.settings = _settings(kv_cache_quantization=False, kv_cache_quantization_group_size=128)
    assert adapter._group_size_problem(model) is None


def test_load_wrapper_unloads_and_raises(adapter):
    model = _tiny_llama()
    adapter.settings = _settings(kv_cache_quantization=True, kv_cache_quantization_group_size=128)

    class Provider:
        model_key = None
        model = None

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            self.model, self.model_key = model, (model_path, None, None)

    load = adapter._wrap_load(Provider._load)
    p = Provider()
    with pytest.raises(_StartupError, match="head dimension 64"):
        load(p, "path")
    assert p.model is None and p.model_key is None
    default = adapter._wrap_load_default(lambda provider: load(provider, "path"))
    with pytest.raises(SystemExit) as exc:  # in the main thread: a clean exit 2
        default(p)
    assert exc.value.code == 2


# --------------------------------------------------------------------------- fingerprint





def test_batched_path_caches_stay_bounded(adapter):
    """``--max-kv-size`` on mlx-lm's BatchGenerator: our caches are merged into
    BatchRotatingKVCache, which stays within N (+ prefill chunk - 1 while prefilling)."""
    N, CHUNK = 32, 16
    model = _tiny_llama()
    mx.eval(model.parameters())
    adapter.install(mlx_lm_server)
    adapter.settings = _settings(max_kv_size=N)
    adapter.create_service(max_bytes=None, max_entries=None)
    assert cache_mod.BatchRotatingKVCache.step == N
    bg = gen_mod.BatchGenerator(model, max_tokens=40, prefill_step_size=CHUNK)
    bg.insert([[t % 32 for t in range(1, 90)], [t % 32 for t in range(3, 50)]],
              max_tokens=[40, 40])
    largest = decoded = 0
    for _ in range(500):
        bg.next()
        for batch in (bg._prompt_batch, bg._generation_batch):
            for c in batch.prompt_cache:
                assert isinstance(c, cache_mod.BatchRotatingKVCache)
                if c.keys is not None:
                    largest = max(largest, c.keys.shape[2])
                    if batch is bg._generation_batch:
                        decoded += 1
                        assert c.keys.shape[2] <= N
        if not (len(bg._generation_batch) or len(bg._prompt_batch) or bg._unprocessed_sequences):
            break
    assert decoded and N <= largest <= N + CHUNK - 1


def _provider():
    cli = types.SimpleNamespace(prompt_cache_bytes=None, prompt_cache_size=10)
    return types.SimpleNamespace(cli_args=cli)


def test_run_configures_then_unconfigures_at_shutdown(adapter):
    from kvplugin.hookspecs import hookimpl

    seen = []

    class Watch:
        @hookimpl
        def kvplugin_configure(self, settings, host):
            seen.append(("configure", host))

        @hookimpl
        def kvplugin_unconfigure(self, settings, host):
            seen.append(("unconfigure", host))

    plugins.get_plugin_manager().register(Watch())
    assert adapter.install(mlx_lm_server)
    adapter.settings = _settings()
    run = adapter._wrap_run(lambda host, port, provider: seen.append(("serving",)) or "done")
    assert run("127.0.0.1", 0, _provider()) == "done"
    assert seen == [("configure", "mlx-lm"), ("serving",), ("unconfigure", "mlx-lm")]


def test_plugin_refusing_configure_stops_run_with_exit_2(adapter, capsys):
    from kvplugin.hookspecs import hookimpl
    from kvplugin.settings import SettingsError

    class Refuse:
        @hookimpl
        def kvplugin_configure(self, settings, host):
            raise SettingsError("kvp: no")

    plugins.get_plugin_manager().register(Refuse())
    assert adapter.install(mlx_lm_server)
    adapter.settings = _settings()
    run = adapter._wrap_run(lambda *a: pytest.fail("served despite the refusal"))
    with pytest.raises(SystemExit) as exit_:
        run("127.0.0.1", 0, _provider())
    assert exit_.value.code == 2 and "kvp: no" in capsys.readouterr().err


def test_install_registers_the_prealloc_class_through_the_registry(adapter, monkeypatch):
    monkeypatch.delattr(cache_mod, "PreallocatedRotatingKVCache", raising=False)
    assert adapter.install(mlx_lm_server)
    assert cache_mod.PreallocatedRotatingKVCache is PreallocatedRotatingKVCache
    adapter.uninstall()
    assert not hasattr(cache_mod, "PreallocatedRotatingKVCache")
