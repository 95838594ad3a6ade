"""Real ``mlx-openai-server launch`` replicas share a real ``redis-server``
(``--kv-cache-remote``), answering as stock; ``--max-memory`` refuses a request that can
never fit with 413 naming the limit, and the server goes on serving."""

from __future__ import annotations

import time

import harness
import pytest
from harness import answer_text, mlx_openai_server_cmd

from kvplugin.tools.hostproc import ServerHTTPError
from kvplugin.tools.models.corpus import CORPUS

MAX_TOKENS = 8
LIMIT = 80 << 20  # the KV-heavy model holds ~10 MiB; a 4k-token prompt needs ~90 MiB


@pytest.fixture(scope="module")
def stock(start_server):
    return start_server(mlx_openai_server_cmd, env={"KVPLUGIN_DISABLE": "1"})


@pytest.fixture(scope="module")
def replicas(start_server, redis_server):
    remote = ("--kv-cache-remote", redis_server.url)
    return start_server(mlx_openai_server_cmd, *remote), start_server(mlx_openai_server_cmd,
                                                                      *remote)


def test_a_prefix_one_replica_computed_is_reused_by_the_other(stock, replicas):
    writer, reader = replicas
    system = harness.briefing(7)
    first = [system, {"role": "user", "content": "Tell me about the bridge."}]
    second = [system, {"role": "user", "content": "When does the bakery open?"}]
    puts = writer.get("/kvplugin/stats")["remote_puts"]
    assert answer_text(writer.chat(first, max_tokens=MAX_TOKENS)) == answer_text(
        stock.chat(first, max_tokens=MAX_TOKENS))
    harness.wait_published(writer, puts + 1)
    before = reader.get("/kvplugin/stats")
    r = reader.chat(second, max_tokens=MAX_TOKENS)
    after = reader.get("/kvplugin/stats")
    assert answer_text(r) == answer_text(stock.chat(second, max_tokens=MAX_TOKENS))
    assert after["remote_hits"] > before["remote_hits"], after
    assert harness.cached_tokens(r) >= r["usage"]["prompt_tokens"] // 2, r["usage"]


@pytest.fixture(scope="module")
def limited(start_server, tmp_path_factory):
    from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

    model = build_kv_heavy_model(tmp_path_factory.mktemp("kv-heavy"))
    return start_server(mlx_openai_server_cmd, "--max-memory", str(LIMIT), model_dir=model)


def test_a_request_that_can_never_fit_gets_413_and_the_server_goes_on(limited):
    deadline = time.monotonic() + 60
    while (stats := limited.get("/kvplugin/stats"))["admission_base"] is None:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["max_memory"] == LIMIT
    with pytest.raises(ServerHTTPError) as err:
        limited.chat(" ".join((CORPUS.split() * 8)[:3000]), max_tokens=8)
    assert err.value.status == 413, err.value
    message = str(err.value.body)
    assert "--max-memory" in message and "KVPLUGIN_MAX_MEMORY" in message, message
    assert answer_text(limited.chat("A short question about farms?", max_tokens=8)).strip()
    after = harness.wait_released(limited)
    assert after["refused_too_large"] == stats["refused_too_large"] + 1
