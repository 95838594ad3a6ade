"""A real ``vllm-mlx serve`` (``--continuous-batching``) and a real ``mlx_lm.server`` share a
prefix through a real ``redis-server`` that speaks TLS only and admits one ACL user
(``rediss://user:pass@127.0.0.1:PORT/0?ssl_ca_certs=``, a certificate made at test time).
The password never shows in what vllm-mlx logs (its own start-up lines included), in
``GET /kvplugin/stats`` or in ``/metrics``.
"""

from __future__ import annotations

import harness
import pytest
from harness import vllm_mlx_serve_cmd

from kvplugin.tools.redisproc import RedisServer

USER, PASSWORD = "kv-vllm", "tls-pw-93b2f6d4"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tls_redis():
    with RedisServer(tls=True, username=USER, password=PASSWORD) as server:
        yield server


def test_a_prefix_crosses_tls_redis_and_the_password_never_shows(start_server, tls_redis):
    writer = start_server(harness.mlx_lm_server_cmd, "--kv-cache-remote", tls_redis.url)
    reader = start_server(vllm_mlx_serve_cmd, "--continuous-batching", "--enable-metrics",
                          "--kv-cache-remote", tls_redis.url)
    system = harness.briefing(61)
    puts = writer.get("/kvplugin/stats")["remote_puts"]
    writer.chat([system, {"role": "user", "content": "Tell me about the bridge."}],
                max_tokens=MAX_TOKENS)
    harness.wait_published(writer, puts + 1)
    before = reader.get("/kvplugin/stats")
    r = reader.chat([system, {"role": "user", "content": "When does the bakery open?"}],
                    max_tokens=MAX_TOKENS)
    after = reader.get("/kvplugin/stats")
    assert after["remote_hits"] == before["remote_hits"] + 1, after
    reused = after["store_tokens_reused"] - before["store_tokens_reused"]
    assert reused >= r["usage"]["prompt_tokens"] // 2, (reused, r["usage"])
    assert after["remote_url"].startswith(f"rediss://{USER}:***@127.0.0.1:")
    log = reader.log_text().split("\n", 1)[1]  # what the server wrote, not the harness's "$ cmd"
    assert f"remote rediss://{USER}:***@" in log and PASSWORD not in log
    status, metrics = reader.request("GET", "/metrics")
    assert status == 200 and "kvplugin_remote_hits_total" in str(metrics)
    assert PASSWORD not in str(metrics) and PASSWORD not in str(after)
