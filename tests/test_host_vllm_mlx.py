"""The vllm-mlx adapter's pieces, in-process, against fakes of vllm-mlx (no server).

vllm-mlx is never imported here: its modules are stand-ins put into ``sys.modules`` for one
test, so these tests run in every tox env, the mlx-lm ones included (where vllm-mlx is not
installed). mlx, mlx-lm's caches and kvplugin's session are real. The real host is covered
by ``integration/test_vllm_mlx_*.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import os
import sys
import types

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvplugin.hosts import vllm_mlx as host
from kvplugin.hosts.vllm_mlx import batching, metrics, salt, simple
from kvplugin.settings import resolve_settings

cache_mod = importlib.import_module("mlx_lm.models.cache")
gen_mod = importlib.import_module("mlx_lm.generate")
mlx_lm = importlib.import_module("mlx_lm")

H, D = 2, 64


def _kv(n: int, seed: int = 0) -> mx.array:
    return mx.random.normal((1, H, n, D), key=mx.random.key(seed)).astype(mx.float16)


def _layer(n: int, seed: int = 0) -> KVCache:
    c = KVCache()
    c.update_and_fetch(_kv(n, seed), _kv(n, seed + 1))
    return c


def _entry(n: int) -> list:
    return [_layer(n, 0), _layer(n, 2)]


def _exact_layer(n: int, seed: int = 0) -> KVCache:
    """A layer without slack: trimming has nothing to cut and returns it as it is."""
    c = KVCache()
    c.keys, c.values, c.offset = _kv(n, seed), _kv(n, seed + 1), n
    return c


# --------------------------------------------------------------------------- fakes of vllm-mlx


def _fake_vllm() -> types.SimpleNamespace:
    """Modules shaped like vllm-mlx 0.6.0's seams (only what the adapter touches)."""
    calls: list = []

    cli = types.ModuleType("vllm_mlx.cli")
    cli.__file__ = "/nowhere/vllm_mlx/cli.py"

    def create_parser():
        p = argparse.ArgumentParser(prog="vllm-mlx")
        sub = p.add_subparsers(dest="command")
        s = sub.add_parser("serve")
        s.add_argument("model")
        s.add_argument("--kv-cache-quantization", action="store_true")
        s.add_argument("--kv-cache-quantization-bits", type=int, default=8, choices=[4, 8])
        s.add_argument("--max-kv-size", type=int, default=0)
        s.add_argument("--continuous-batching", action="store_true")
        s.add_argument("--cache-memory-mb", type=int, default=None)
        return p

    def serve_command(args):
        calls.append(("serve", args))
        return "served"

    cli.create_parser = create_parser
    cli.build_parser = create_parser  # the import-time alias vllm-mlx keeps
    cli.serve_command = serve_command

    mc = types.ModuleType("vllm_mlx.memory_cache")

    class MemoryCacheConfig:
        min_prefix_tokens = 4
        max_entries = 50

        def __init__(self, max_memory_mb=None, max_memory_percent=0.2):
            self.max_memory_mb = max_memory_mb

        def compute_memory_limit(self):
            return (self.max_memory_mb or 64) * 2**20

    class MemoryAwarePrefixCache:
        def __init__(self, model, config=None):
            raise AssertionError("the host's cache must not be built")

    def _detach(cache):
        calls.append(("detach", len(cache)))
        out = []
        for layer in cache:
            c = KVCache()
            c.update_and_fetch(mx.array(layer.keys[..., : layer.offset, :]),
                               mx.array(layer.values[..., : layer.offset, :]))
            out.append(c)
        return out

    mc.MemoryCacheConfig = MemoryCacheConfig
    mc.MemoryAwarePrefixCache = MemoryAwarePrefixCache
    mc._detach_cache_for_storage = _detach
    mc._compute_model_fingerprint = lambda model: f"fake-fp-{type(model).__name__}"

    sched = types.ModuleType("vllm_mlx.scheduler")
    sched.MemoryAwarePrefixCache = MemoryAwarePrefixCache

    class Scheduler:
        def ensure_ssd_tier(self):
            return "host tier"

        def add_request(self, request):  # admission control's seams (--max-memory)
            return "added"

        def _cleanup_finished(self, finished_ids):
            return None

        def abort_request(self, request_id):
            return True

    sched.Scheduler = Scheduler

    server = types.ModuleType("vllm_mlx.server")
    server.load_model = lambda model_name, **kw: calls.append(("load_model", model_name))
    router = types.SimpleNamespace(routes=["host route"])
    server.app = types.SimpleNamespace(router=router, user_middleware=["host middleware"],
                                       middleware_stack=None)
    server._engine = None

    met = types.ModuleType("vllm_mlx.metrics")

    class MetricsCollector:
        def _init_prometheus(self):
            self._prom = {"registry": CollectorRegistry()}

    met.MetricsCollector = MetricsCollector
    met.metrics = None

    batched = types.ModuleType("vllm_mlx.engine.batched")

    class BatchedEngine:
        def save_cache_to_disk(self, cache_dir):
            return True

        def load_cache_from_disk(self, cache_dir):
            return 7

    batched.BatchedEngine = BatchedEngine

    simple_mod = types.ModuleType("vllm_mlx.engine.simple")

    class SimpleEngine:
        def __init__(self, model_name, max_kv_size=0):
            self._model = types.SimpleNamespace(model=_FakeModel())
            self._is_mllm = False
            self._prefix_trie_cache_enabled = True

        async def start(self):
            return "started"

        async def stop(self):
            return "stopped"

        async def _submit_to_generation_worker(self, worker, fn, *args):
            return fn(*args)

    simple_mod.SimpleEngine = SimpleEngine
    simple_mod.build_system_prompt_cache_prefix = lambda *a, **k: "snapshot"

    request_mod = types.ModuleType("vllm_mlx.request")

    @dataclasses.dataclass
    class Request:
        request_id: str
        prompt_token_ids: list | None = None

    request_mod.Request = Request

    engine = types.ModuleType("vllm_mlx.engine")
    engine.__path__ = []
    engine.batched, engine.simple = batched, simple_mod
    pkg = types.ModuleType("vllm_mlx")
    pkg.__path__ = []
    for name, mod in (("cli", cli), ("memory_cache", mc), ("scheduler", sched),
                      ("server", server), ("metrics", met), ("engine", engine),
                      ("request", request_mod)):
        setattr(pkg, name, mod)
    return types.SimpleNamespace(pkg=pkg, cli=cli, memory_cache=mc, scheduler=sched,
                                 server=server, metrics=met, engine=engine, batched=batched,
                                 simple=simple_mod, request=request_mod, calls=calls)


class _FakeModel:
    layers = [0, 0]  # mlx-lm's make_prompt_cache: one KVCache per layer


@pytest.fixture
def fake(monkeypatch):
    f = _fake_vllm()
    for name, mod in (("vllm_mlx", f.pkg), ("vllm_mlx.cli", f.cli),
                      ("vllm_mlx.memory_cache", f.memory_cache),
                      ("vllm_mlx.scheduler", f.scheduler), ("vllm_mlx.server", f.server),
                      ("vllm_mlx.metrics", f.metrics), ("vllm_mlx.engine", f.engine),
                      ("vllm_mlx.engine.batched", f.batched),
                      ("vllm_mlx.engine.simple", f.simple), ("vllm_mlx.request", f.request)):
        monkeypatch.setitem(sys.modules, name, mod)
    # the stats route is a FastAPI route (FastAPI is vllm-mlx's, absent in mlx-lm envs);
    # its handler is tested on its own below
    monkeypatch.setattr(metrics, "stats_route", lambda adapter: ("kvplugin route", adapter))
    monkeypatch.setattr(salt, "middleware", lambda adapter: ("kvplugin middleware", adapter))
    return f


@pytest.fixture
def adapter():
    a = host.VllmMlxAdapter()
    yield a
    a.uninstall()


def _serving(adapter, **flags):
    """An adapter whose runtime has a real session (as stage 2 leaves it)."""
    settings = resolve_settings(flags)
    adapter.runtime.settings = settings
    adapter.runtime.service = adapter.make_session(settings, max_bytes=64 << 20, max_entries=50)
    return adapter.runtime.service


def _owned(*pairs) -> dict:
    return {(id(owner), name): vars(owner).get(name, "<absent>") for owner, name in pairs}


# --------------------------------------------------------------------------- identity / package


def test_entry_point_path_names_the_package_adapter():
    from kvplugin.hosts import get_adapter
    from kvplugin.hostspecs import VLLM_MLX

    assert VLLM_MLX.adapter == "kvplugin.hosts.vllm_mlx:ADAPTER"
    assert get_adapter("vllm-mlx") is host.ADAPTER
    assert callable(importlib.import_module(VLLM_MLX.adapter_module).on_import)


def test_importing_the_package_imports_no_host():
    import subprocess

    code = ("import sys, kvplugin.hosts.vllm_mlx, kvplugin.hosts.vllm_mlx.batching\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm_mlx', 'mlx')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVPLUGIN_DISABLE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_fork_is_not_vllm_mlx(adapter, fake):
    problem = adapter.check_identity(fake.cli)
    assert problem is not None and "vllm" in problem


# --------------------------------------------------------------------------- stage 1: the CLI


def test_cli_adopts_host_flags_and_writes_settings_back(adapter, fake, monkeypatch):
    monkeypatch.setattr(adapter, "install_serving", lambda args, settings: False)
    adapter.apply(fake.cli, adapter.registry)
    assert fake.cli.build_parser is fake.cli.create_parser  # the alias follows
    parser = fake.cli.create_parser()
    args = parser.parse_args(["serve", "/m", "--kv-cache-quantization",
                              "--kv-cache-quantization-bits", "3", "--kv-cache-step", "64"])
    assert fake.cli.serve_command(args) == "served"
    assert args.kv_cache_quantization_bits == 3  # beyond the host's choices [4, 8]
    s = adapter.runtime.settings
    assert (s.kv_cache_quantization, s.kv_cache_quantization_bits, s.kv_cache_step) == (True, 3, 64)
    # given flags sit on the adapter, as on mlx-lm's (say_active reads them)
    assert set(adapter.given_flags) == {"kv_cache_quantization", "kv_cache_quantization_bits",
                                        "kv_cache_step"}
    assert adapter.runtime.model_id == "/m" and adapter.runtime.mode == "simple"


def test_cli_bad_value_exits_2_naming_flag_and_variable(adapter, fake, capsys):
    adapter.apply(fake.cli, adapter.registry)
    args = fake.cli.create_parser().parse_args(["serve", "/m", "--kv-cache-quantization-bits", "9"])
    with pytest.raises(SystemExit) as exc:
        fake.cli.serve_command(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-quantization-bits" in err and "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS" in err
    assert not any(c[0] == "serve" for c in fake.calls)


def test_hot_cache_only_fails_closed_when_serving_cannot_be_patched(adapter, fake, capsys):
    del fake.scheduler.Scheduler.ensure_ssd_tier  # a seam missing: stage 2 cannot patch
    adapter.apply(fake.cli, adapter.registry)
    parser = fake.cli.create_parser()
    assert fake.cli.serve_command(parser.parse_args(["serve", "/m"])) == "served"  # stock
    assert "could not patch vllm-mlx's serving path" in capsys.readouterr().err
    assert not adapter.serving_installed and adapter.runtime.service is None
    with pytest.raises(SystemExit) as exc:
        fake.cli.serve_command(parser.parse_args(["serve", "/m", "--hot-cache-only"]))
    assert exc.value.code == 2
    assert "--hot-cache-only" in capsys.readouterr().err


# --------------------------------------------------------------------------- state on the instance


def test_two_adapters_share_no_state(fake):
    a, b = host.VllmMlxAdapter(), host.VllmMlxAdapter()
    try:
        assert a.runtime is not b.runtime and a.given_flags is not b.given_flags
        cli_b = types.ModuleType("vllm_mlx.cli")
        cli_b.create_parser, cli_b.serve_command = fake.cli.create_parser, fake.cli.serve_command
        a.apply(fake.cli, a.registry)
        b.apply(cli_b, b.registry)
        fake.cli.create_parser()
        assert a.serve_parser is not None and b.serve_parser is None
        _serving(a, max_kv_size=64)
        assert b.runtime.service is None and b.runtime.settings is None
        assert a.runtime.model_key(_FakeModel()) != b.runtime.model_key(_FakeModel())
    finally:
        a.uninstall()
        b.uninstall()


# --------------------------------------------------------------------------- stage 2 and uninstall


def test_serving_patches_every_seam_and_uninstall_restores_everything(adapter, fake):
    f = fake
    seams = [(f.cli, "create_parser"), (f.cli, "build_parser"), (f.cli, "serve_command"),
             (gen_mod, "stream_generate"), (mlx_lm, "stream_generate"),
             (f.simple, "build_system_prompt_cache_prefix"), (f.simple.SimpleEngine, "__init__"),
             (f.simple.SimpleEngine, "start"), (f.simple.SimpleEngine, "stop"),
             (f.scheduler, "MemoryAwarePrefixCache"), (f.scheduler.Scheduler, "ensure_ssd_tier"),
             (f.scheduler.Scheduler, "add_request"), (f.scheduler.Scheduler, "_cleanup_finished"),
             (f.scheduler.Scheduler, "abort_request"),
             (cache_mod.BatchKVCache, "step"),
             (f.batched.BatchedEngine, "save_cache_to_disk"),
             (f.batched.BatchedEngine, "load_cache_from_disk"), (f.server, "load_model"),
             (f.metrics.MetricsCollector, "_init_prometheus"), (f.server.app.router, "routes"),
             (f.server.app, "user_middleware"), (f.request.Request, "__init__"),
             (f.simple.SimpleEngine, "_submit_to_generation_worker")]
    before = _owned(*seams)
    routes = f.server.app.router.routes
    adapter.apply(f.cli, adapter.registry)  # stage 1 as install does (no version gate here)
    adapter.installed = True
    args = f.cli.create_parser().parse_args(
        # changed on purpose: no --max-kv-size here, the batching mode now refuses it
        # (its batch cache keeps no first tokens), so BatchRotatingKVCache.step is not set
        ["serve", "/m", "--continuous-batching", "--hot-cache-only",
         "--kv-cache-step", "128", "--cache-memory-mb", "32"])
    assert f.cli.serve_command(args) == "served"
    assert adapter.serving_installed
    from patches import unmarked

    assert unmarked(adapter.registry) == [] == unmarked(adapter.serving)
    during = _owned(*seams)
    changed = {k for k in before if before[k] is not during[k]}
    assert changed == set(before)  # every seam replaced (or added)
    assert cache_mod.BatchKVCache.step == 128
    assert adapter.runtime.service.store.max_bytes == 32 << 20  # the host's own budget
    assert f.batched.BatchedEngine().save_cache_to_disk("/x") is False  # hot only: no disk
    assert f.scheduler.Scheduler().ensure_ssd_tier() == "host tier"  # not kvplugin's cache
    assert f.server.app.router.routes[-1][0] == "kvplugin route"
    mc = f.metrics.MetricsCollector()
    mc._init_prometheus()
    assert len(adapter.runtime.collectors) == 1

    adapter.uninstall()
    after = _owned(*seams)
    assert all(before[k] is after[k] for k in before)  # identity, not just equality
    assert f.server.app.router.routes is routes and routes == ["host route"]
    assert adapter.runtime.service is None and adapter.runtime.collectors == []
    assert adapter.given_flags == {} and adapter.serve_parser is None
    assert list(mc._prom["registry"].collect()) == []  # our collector taken off again


def test_load_model_runs_the_model_check_from_config(adapter, fake, tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"head_dim": 48, "hidden_size": 96, '
                                          '"num_attention_heads": 2}')
    adapter.apply(fake.cli, adapter.registry)
    args = fake.cli.create_parser().parse_args(["serve", "no-such-model",
                                                "--kv-cache-quantization"])
    fake.cli.serve_command(args)  # path unknown: the check waits for load_model
    assert adapter.serving_installed and not adapter.runtime.group_size_checked
    with pytest.raises(SystemExit) as exc:
        fake.server.load_model(str(tmp_path))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-quantization-group-size" in err and "the default 64" in err
    assert ("load_model", str(tmp_path)) not in fake.calls  # stopped before the weights


# --------------------------------------------------------------------------- simple mode


class _Tok(TokenizerWrapper):
    """Already mlx-lm's wrapper (so nothing re-wraps it); prompts here are token lists, so
    it is never asked to encode."""

    def __init__(self) -> None:  # no HF tokenizer behind it
        pass


@dataclasses.dataclass
class _Resp:
    token: int
    prompt_tokens: int


def _fake_stream_generate(seen: list, fail_at: int | None = None):
    """mlx-lm's loop in miniature: the prompt goes into the cache, every token but the last
    is fed back; responses report the prompt length they were given."""

    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kw):
        cache = kw.get("prompt_cache")
        n = int(prompt.size) if isinstance(prompt, mx.array) else len(prompt)
        seen.append({"prompt": prompt, "cache": cache, "draft": draft_model, "kw": kw})
        if cache is not None:
            for layer in cache:
                layer.update_and_fetch(_kv(n), _kv(n))
        for i in range(max_tokens):
            if fail_at is not None and i == fail_at:
                raise RuntimeError("generation failed")
            if i and cache is not None:
                for layer in cache:
                    layer.update_and_fetch(_kv(1), _kv(1))
            yield _Resp(100 + i, n)

    return stream_generate


def _registered(adapter, seen, **kw):
    service = _serving(adapter)
    model = _FakeModel()
    adapter.runtime.simple_models[id(model)] = "key"
    sg = simple.wrap_stream_generate(_fake_stream_generate(seen, **kw), adapter)
    return service, model, sg


def test_stream_generate_stores_then_reuses_the_prefix(adapter):
    seen: list = []
    service, model, sg = _registered(adapter, seen)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    out = list(sg(model, _Tok(), prompt, max_tokens=3))
    assert [r.token for r in out] == [100, 101, 102]
    assert len(service.store) == 1  # prompt + 2 fed tokens, keyed by what the cache holds
    follow = prompt + [100, 101, 102, 7, 8]
    out = list(sg(model, _Tok(), follow, max_tokens=2))
    assert seen[1]["prompt"].tolist() == [102, 7, 8]  # only the uncached tail is processed
    assert seen[1]["cache"][0].offset == 10 + 3 + 1  # the reused entry grew on
    assert all(r.prompt_tokens == len(follow) for r in out)  # reported as the whole prompt
    stats = service.stats()
    assert (stats["store_hits"], stats["store_tokens_reused"]) == (1, 10)


@pytest.mark.parametrize("call", [
    {"draft_model": object()},
    {"prompt_cache": [KVCache()]},
    {"kv_bits": 4},
])
def test_stream_generate_leaves_non_plain_calls_stock(adapter, call):
    seen: list = []
    service, model, sg = _registered(adapter, seen)
    list(sg(model, _Tok(), [1, 2, 3, 4], max_tokens=2, **call))
    assert seen[0]["prompt"] == [1, 2, 3, 4]  # untouched, not an mx.array of the tail
    assert len(service.store) == 0 and service.stats()["caches_made"] == 0


def test_stream_generate_ignores_unregistered_models(adapter):
    seen: list = []
    service, _, sg = _registered(adapter, seen)
    list(sg(_FakeModel(), _Tok(), [1, 2, 3], max_tokens=2))
    assert seen[0]["cache"] is None and len(service.store) == 0


def test_stream_generate_stores_on_early_stop_not_on_failure(adapter):
    seen: list = []
    service, model, sg = _registered(adapter, seen)
    gen = sg(model, _Tok(), [1, 2, 3, 4, 5], max_tokens=5)
    next(gen)
    gen.close()  # the consumer stopped (a stop string)
    assert len(service.store) == 1
    _, model2, failing = _registered(adapter, seen, fail_at=1)
    service = adapter.runtime.service
    with pytest.raises(RuntimeError):
        list(failing(model2, _Tok(), [9, 8, 7, 6], max_tokens=3))
    assert len(service.store) == 0


def test_simple_engine_registers_its_model_and_switches_host_caches_off(adapter, fake):
    _serving(adapter)
    adapter.runtime.model_id = None  # --models-config: keyed by the host's fingerprint
    se = fake.simple.SimpleEngine
    init = simple.wrap_init(se.__init__)
    start, stop = simple.wrap_start(se.start, adapter), simple.wrap_stop(se.stop, adapter)
    engine = se.__new__(se)
    init(engine, "m")
    assert engine._prefix_trie_cache_enabled is False
    assert asyncio.run(start(engine)) == "started"
    model = engine._model.model
    assert adapter.runtime.simple_models == {id(model): "vllm-mlx|fake-fp-_FakeModel|max_kv=0"}
    assert asyncio.run(stop(engine)) == "stopped"
    assert adapter.runtime.simple_models == {}
    assert simple.no_system_prefix_snapshot("anything") is None


# --------------------------------------------------------------------------- batching mode


def _prefix_cache(adapter, fake, **flags):
    service = _serving(adapter, **flags)
    cls = batching.bind_prefix_cache(fake.memory_cache, adapter)
    return service, cls(_FakeModel(), fake.memory_cache.MemoryCacheConfig())


def test_prefix_cache_is_the_hosts_class_backed_by_the_session(adapter, fake):
    service, pc = _prefix_cache(adapter, fake)
    assert isinstance(pc, fake.memory_cache.MemoryAwarePrefixCache)
    assert isinstance(pc, batching.KVPrefixCache) and pc.kvplugin is True
    tokens = list(range(1, 13))
    assert pc.store(tokens, _entry(10)) is True  # keyed by the 10 tokens it holds
    assert len(pc) == 1 and len(pc._entries) == 1 and pc._current_memory == service.store.nbytes
    assert pc.store([1, 2, 3], _entry(3)) is False  # below min_prefix_tokens (4)
    cache, rest = pc.fetch(tokens + [99])
    assert cache is not None and rest == [11, 12, 99]
    assert pc._last_match_type == "prefix" and pc._last_matched_key == tuple(range(1, 11))
    assert len(pc) == 0  # moved to the request, not copied
    again, rest = pc.fetch(tokens)  # the first is still out: a copy of what it holds
    assert again is not None and rest == [11, 12] and again[0] is not cache[0]
    assert service.store.stats().lent_copies == 1
    stats = pc.get_stats()
    assert (stats["hits"], stats["misses"], stats["entry_count"]) == (2, 0, 0)
    assert stats["backend"] == "kvplugin" and stats["max_memory_mb"] == 64.0


def test_prefix_cache_detaches_layers_the_session_returned_unchanged(adapter, fake):
    _, pc = _prefix_cache(adapter, fake)
    live = [_exact_layer(8, 0), _exact_layer(8, 2)]
    key, entry, _ = pc.prepare_store(list(range(8)), live)
    assert key == tuple(range(8))
    assert not any(a is b for a, b in zip(entry, live))  # no view of the live batch is kept
    assert ("detach", 2) in fake.calls


def test_prefix_cache_persists_under_its_own_subdirectory(adapter, fake, tmp_path):
    _, pc = _prefix_cache(adapter, fake)
    pc.store(list(range(1, 11)), _entry(10))
    assert pc.save_to_disk(str(tmp_path)) is True
    assert (tmp_path / "kvplugin").is_dir() and list((tmp_path / "kvplugin").iterdir())
    other = host.VllmMlxAdapter()
    try:
        _, pc2 = _prefix_cache(other, fake)
        assert pc2.load_from_disk(str(tmp_path)) == 1
        cache, rest = pc2.fetch(list(range(1, 12)))
        assert cache is not None and rest == [11]
    finally:
        other.runtime.service.close()
        other.uninstall()


def test_prefix_cache_under_hot_cache_only_never_writes(adapter, fake, tmp_path):
    _, pc = _prefix_cache(adapter, fake, hot_cache_only=True)
    pc.store(list(range(1, 11)), _entry(10))
    assert pc.save_to_disk(str(tmp_path)) is False
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- metrics and stats


def _scrape(registry) -> dict:
    return {s.name: s.value for fam in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in fam.samples}


def test_collector_serves_the_session_counters(adapter, fake):
    service, pc = _prefix_cache(adapter, fake)
    owner = types.SimpleNamespace(_prom={"registry": CollectorRegistry()})
    metrics.register_collector(owner, adapter)
    metrics.register_collector(owner, adapter)  # once per registry
    assert len(adapter.runtime.collectors) == 1
    pc.store(list(range(1, 11)), _entry(10))
    pc.fetch(list(range(1, 12)))
    pc.fetch([7, 7, 7, 7, 7])
    got, stats = _scrape(owner._prom["registry"]), service.stats()
    assert got["kvplugin_entries_stored_total"] == stats["entries_stored"] == 1
    assert got["kvplugin_hits_total"] == stats["store_hits"] == 1
    assert got["kvplugin_misses_total"] == stats["store_misses"] == 1
    assert got["kvplugin_tokens_reused_total"] == stats["store_tokens_reused"] == 10
    assert got["kvplugin_entries"] == stats["store_entries"] == 0
    tiers = ("cold_", "remote_")  # no sample without that tier
    names = {f"kvplugin_{n}_total" for n, _, _ in metrics.COUNTERS if not n.startswith(tiers)}
    names |= {f"kvplugin_{n}" for n, _, _ in metrics.GAUGES if not n.startswith(tiers)}
    assert names <= set(got)
    assert "kvplugin_cold_entries" not in got  # no cold tier: no sample, never a fake -1
    metrics.unregister_collectors(adapter.runtime)
    assert _scrape(owner._prom["registry"]) == {}


def test_collector_without_a_session_has_no_samples(adapter):
    registry = CollectorRegistry()
    registry.register(metrics.KVCollector(lambda: metrics._stats(adapter)))
    assert _scrape(registry) == {}


def test_stats_handler_reports_session_and_mode(adapter, fake):
    handler = metrics.stats_handler(adapter)
    assert asyncio.run(handler()) == {"host": "vllm-mlx", "active": False}
    service, pc = _prefix_cache(adapter, fake)
    adapter.runtime.mode = "batching"
    pc.store(list(range(1, 11)), _entry(10))
    body = asyncio.run(handler())
    assert body["mode"] == "continuous-batching" and body["host"] == "vllm-mlx"
    assert body["entries"][0]["tokens"] == 10 and body["store_entries"] == 1
    assert "host_version" in body

