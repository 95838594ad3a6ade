"""Shared fixtures: every test starts with no KVPLUGIN_* variables and a fresh manager."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_kvplugin_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVPLUGIN_"):
            monkeypatch.delenv(name)
    from kvplugin import log, plugins

    plugins.reset_plugin_manager()
    log.forget()
    yield
    plugins.reset_plugin_manager()


@pytest.fixture
def tiny_llama():
    """A 2-layer llama with random weights (a host's loaded model, for start-up work)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=2, rms_norm_eps=1e-5,
                           vocab_size=128, num_key_value_heads=1)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


#: the remote tier's block in the tests that drive it (small, so short entries span blocks)
REMOTE_BLOCK = 64


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on 127.0.0.1 for the module (fails loudly when not installed)."""
    from kvplugin.tools.redisproc import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def tier(redis_server):
    """``make(**kw)``: remote tiers on an emptied Redis (block 64), closed at the end."""
    from kvplugin.cache.tiers.remote import RemoteTier

    redis_server.client().flushall()
    made = []

    def make(**kw):
        kw.setdefault("entry_format", "full")
        kw.setdefault("block_tokens", REMOTE_BLOCK)
        kw.setdefault("fetch_timeout_ms", 2000)
        made.append(RemoteTier(redis_server.url, **kw))
        return made[-1]

    yield make
    for t in made:
        t.close()
