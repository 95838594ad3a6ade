"""The mlx-openai-server adapter on fakes (the real host: integration/test_mlx_openai_server_*):
version gating said once across its two processes, all-or-nothing patches of the server's
seams, ``source`` tags kept apart, flags handed to the model process as variables."""

from __future__ import annotations

import os
import types

import pytest

from kvplugin import log
from kvplugin.hosts.mlx_openai_server import adapter as oai
from kvplugin.hosts.mlx_openai_server.options import export
from kvplugin.hosts.mlx_openai_server.prompt_cache import KVPluginOaiPromptCache


def _fake_server() -> types.ModuleType:
    server = types.ModuleType("app.server")

    def setup_server(config_args):
        return types.SimpleNamespace(app=None)

    def create_handler_from_config(model_cfg):
        return object()

    class HandlerProcessProxy:
        async def _call(self, method_name, *args, **kwargs):
            return None

        async def _wait_for_ready(self, ready_queue, timeout=300):
            return {}

    server.setup_server = setup_server
    server.create_handler_from_config = create_handler_from_config
    server.HandlerProcessProxy = HandlerProcessProxy
    return server


@pytest.fixture
def adapter(monkeypatch):
    from packaging.version import Version

    a = oai.MlxOpenaiServerAdapter()
    monkeypatch.setattr(a, "version", lambda: Version("1.8.1"))
    log.forget()
    yield a
    a.uninstall()


def test_install_patches_every_server_seam_and_uninstall_restores_them(adapter):
    from patches import unmarked

    server = _fake_server()
    before = dict(vars(server)), dict(vars(server.HandlerProcessProxy))
    assert adapter.install(server)
    assert len(adapter.registry) == 3 and unmarked(adapter.registry) == []
    assert server.setup_server is not before[0]["setup_server"]
    adapter.uninstall()
    assert server.setup_server is before[0]["setup_server"]
    assert vars(server.HandlerProcessProxy)["_wait_for_ready"] is before[1]["_wait_for_ready"]


def test_a_foreign_module_is_left_stock(adapter, capsys):
    server = _fake_server()
    del server.HandlerProcessProxy._wait_for_ready
    assert adapter.install(server) is False and len(adapter.registry) == 0
    assert "HandlerProcessProxy._wait_for_ready" in capsys.readouterr().err


@pytest.mark.parametrize("child", [False, True], ids=["server", "model-process"])
def test_an_unsupported_version_is_said_once_by_the_server_only(adapter, monkeypatch, capsys,
                                                                 child):
    from packaging.version import Version

    monkeypatch.setattr(adapter, "version", lambda: Version("1.9.0"))
    monkeypatch.setattr(oai, "spawned_child", lambda: child)
    server = _fake_server()
    assert adapter.install(server) is False and len(adapter.registry) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvplugin:")]
    expected = [] if child else [
        "kvplugin: mlx-openai-server 1.9.0 is outside kvplugin's supported range "
        "<1.9,>=1.8.1; mlx-openai-server runs stock"]
    assert lines == expected


class _Service:
    """What the prompt cache asks of a service, recording the keys it fetches under."""

    def __init__(self):
        self.fetched: list[str] = []

    def model_key(self, fingerprint):
        return f"model:{fingerprint}"

    salted_key = staticmethod(lambda key, salt: key if salt is None else f"{key}#{salt}")

    def fetch(self, key, tokens, *, model=None):
        self.fetched.append(key)
        return None, 0


def test_source_tags_keep_the_two_paths_apart(monkeypatch):
    service = _Service()
    monkeypatch.setattr(KVPluginOaiPromptCache, "adapter", types.SimpleNamespace(
        create_service=lambda **kw: (service, None)))
    monkeypatch.setattr("kvplugin.hosts.mlx_openai_server.prompt_cache.model_fingerprint",
                        lambda model: "fp")
    cache = KVPluginOaiPromptCache(max_size=4, max_bytes=1 << 63, cache_dir=None)
    cache.bind(object())
    assert cache.fetch_nearest_cache([1, 2, 3], allowed_sources={"batch"}) == (None, [1, 2, 3])
    cache.fetch_nearest_cache([1, 2, 3], allowed_sources={"nonbatch"})
    assert service.fetched == ["model:fp", "model:fp#source:nonbatch"]


def test_flags_reach_the_model_process_as_variables(monkeypatch):
    for name in ("KVPLUGIN_KV_CACHE_QUANTIZATION", "KVPLUGIN_MAX_KV_SIZE",
                 "KVPLUGIN_SSD_CACHE_MAX_GB"):
        monkeypatch.setenv(name, "")  # restored (or removed) after the test
    export({"kv_cache_quantization": True, "max_kv_size": 4096, "ssd_cache_max_gb": 1.5})
    assert os.environ["KVPLUGIN_KV_CACHE_QUANTIZATION"] == "true"
    assert os.environ["KVPLUGIN_MAX_KV_SIZE"] == "4096"
    assert os.environ["KVPLUGIN_SSD_CACHE_MAX_GB"] == "1.5"


@pytest.mark.parametrize("private", [False, True])
def test_shut_down_writes_held_entries_out_only_where_the_directory_is_kept(monkeypatch,
                                                                              tmp_path, private):
    calls: list[str] = []
    service = types.SimpleNamespace(flush_configured=lambda: calls.append("flush"),
                                    close=lambda: calls.append("close"))
    scratch = types.SimpleNamespace(cleanup=lambda: calls.append("cleanup")) if private else None
    monkeypatch.setattr(KVPluginOaiPromptCache, "adapter", types.SimpleNamespace(
        create_service=lambda **kw: (service, scratch)))
    KVPluginOaiPromptCache(cache_dir=None if private else str(tmp_path)).close()
    assert calls == (["close", "cleanup"] if private else ["flush", "close"])
