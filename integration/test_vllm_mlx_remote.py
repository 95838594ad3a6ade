"""Replicas of real ``vllm-mlx serve`` processes share one real ``redis-server``
(``--kv-cache-remote``): default mode and ``--continuous-batching`` reuse each other's
prefixes, and a mixed pair (``mlx_lm.server`` + ``vllm-mlx serve`` of one checkpoint) shares
too. Every answer equals a stock server's (fp16).
"""

from __future__ import annotations


import harness
import pytest
from harness import answer_text, vllm_mlx_serve_cmd


CB = ("--continuous-batching",)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stock(start_server):
    return start_server(vllm_mlx_serve_cmd, env={"KVPLUGIN_DISABLE": "1"})


@pytest.fixture(scope="module")
def servers(start_server, redis_server):
    remote = ("--kv-cache-remote", redis_server.url)
    return {
        "default": start_server(vllm_mlx_serve_cmd, *remote),
        "batching": start_server(vllm_mlx_serve_cmd, *remote, *CB),
        "mlx-lm": start_server(harness.mlx_lm_server_cmd, *remote),
    }


def _stats(srv) -> dict:
    return srv.get("/kvplugin/stats")


@pytest.mark.parametrize("writer, reader", [("default", "batching"), ("batching", "default"),
                                            ("mlx-lm", "default"), ("default", "mlx-lm")])
def test_a_prefix_one_replica_computed_is_reused_by_another(stock, servers, writer, reader):
    case = ["default", "batching", "mlx-lm"].index(writer) * 3 + ["default", "batching",
                                                                  "mlx-lm"].index(reader)
    system = harness.briefing(case)
    first = [system, {"role": "user", "content": "Tell me about the bridge."}]
    second = [system, {"role": "user", "content": "When does the bakery open?"}]
    a, b = servers[writer], servers[reader]
    puts = _stats(a)["remote_puts"]
    assert answer_text(a.chat(first, max_tokens=MAX_TOKENS)) == answer_text(
        stock.chat(first, max_tokens=MAX_TOKENS))
    harness.wait_published(a, puts + 1)
    before = _stats(b)
    r = b.chat(second, max_tokens=MAX_TOKENS)
    after = _stats(b)
    assert answer_text(r) == answer_text(stock.chat(second, max_tokens=MAX_TOKENS))
    assert after["remote_hits"] > before["remote_hits"], after
    reused = after["store_tokens_reused"] - before["store_tokens_reused"]
    assert reused >= r["usage"]["prompt_tokens"] // 2, (reused, r["usage"])


def test_redis_stopped_mid_run_leaves_every_mode_answering(stock, servers, redis_server):
    redis_server.stop()
    try:
        for i, name in enumerate(("default", "batching", "mlx-lm")):
            messages = [harness.briefing(20 + i), {"role": "user", "content": "Who lives here?"}]
            r = servers[name].chat(messages, max_tokens=MAX_TOKENS)
            assert answer_text(r) == answer_text(stock.chat(messages, max_tokens=MAX_TOKENS))
            stats = _stats(servers[name])
            assert stats["remote_connected"] == 0, (name, stats)
    finally:
        redis_server.start()


def test_a_wrong_password_stops_vllm_mlx_before_it_listens(tiny_model):
    from kvplugin.tools.redisproc import RedisServer

    with RedisServer(password="right") as server:
        url = server.url.replace(":right@", ":wrong@")
        r = harness.run_command(vllm_mlx_serve_cmd(tiny_model, harness.free_port(),
                                                   "--kv-cache-remote", url), timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "--kv-cache-remote / KVPLUGIN_KV_CACHE_REMOTE" in out and ":wrong@" not in out
    assert "Uvicorn running" not in out and "Application startup complete" not in out
