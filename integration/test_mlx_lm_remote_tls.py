"""Two real ``mlx_lm.server`` replicas share prefixes through a real ``redis-server`` that
speaks TLS only and admits one ACL user: ``rediss://user:pass@127.0.0.1:PORT/0?ssl_ca_certs=``.

The certificate is made at test time (``openssl``, a throw-away CA). The password never shows:
not in the start-up line or anything else the server logs, not in ``GET /kvplugin/stats`` or
``/metrics``, not in ``kvplugin info``, not in the message of a start-up that fails.
"""

from __future__ import annotations

import harness
import pytest

from kvplugin.cache.tiers.remote_keys import PREFIX
from harness import answer_text, cached_tokens, run_command, venv_script

from kvplugin.tools.redisproc import RedisServer

USER, PASSWORD = "kv-replica", "tls-pw-41c9e07a"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tls_redis():
    with RedisServer(tls=True, username=USER, password=PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def replicas(start_server, tls_redis):
    # one replica takes the URL as a flag, the other from the environment
    return (start_server(harness.mlx_lm_server_cmd, "--kv-cache-remote", tls_redis.url),
            start_server(harness.mlx_lm_server_cmd,
                         env={"KVPLUGIN_KV_CACHE_REMOTE": tls_redis.url}))


def test_replicas_share_a_prefix_over_tls_as_an_acl_user(replicas, tls_redis):
    a, b = replicas
    system = harness.briefing(60)
    puts = a.get("/kvplugin/stats")["remote_puts"]
    a.chat([system, {"role": "user", "content": "Tell me about the bridge."}],
           max_tokens=MAX_TOKENS)
    harness.wait_published(a, puts + 1)
    r = b.chat([system, {"role": "user", "content": "When does the bakery open?"}],
               max_tokens=MAX_TOKENS)
    assert answer_text(r)
    assert cached_tokens(r) >= r["usage"]["prompt_tokens"] // 2, r["usage"]
    stats = b.get("/kvplugin/stats")
    assert stats["remote_hits"] >= 1 and stats["remote_connected"] == 1, stats
    assert stats["remote_url"].startswith(f"rediss://{USER}:***@127.0.0.1:")
    assert len(tls_redis.client().keys(PREFIX + ":*")) >= 2  # written through the TLS port


def test_the_password_never_shows(replicas, tls_redis):
    for srv in replicas:
        log = srv.log_text().split("\n", 1)[1]  # what the server wrote (not the harness's "$ cmd")
        assert f"remote rediss://{USER}:***@127.0.0.1:{tls_redis.port}/0" in log, log[-2000:]
        assert PASSWORD not in log
        status, stats = srv.request("GET", "/kvplugin/stats")
        status_m, metrics = srv.request("GET", "/metrics")
        assert status == status_m == 200
        assert PASSWORD not in str(stats) and PASSWORD not in str(metrics)
    for args, env in ((["info"], {"KVPLUGIN_KV_CACHE_REMOTE": tls_redis.url}),
                      (["info", "--json", "--kv-cache-remote", tls_redis.url], None)):
        r = run_command([str(venv_script("kvplugin")), *args], env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"{USER}:***@" in r.stdout and PASSWORD not in r.stdout + r.stderr


@pytest.mark.parametrize("change, why", [
    (lambda url: url.replace(PASSWORD, "x" + PASSWORD), "refused the credentials"),
    (lambda url: url.split("?")[0], "ssl_ca_certs"),
], ids=["wrong-password", "unknown-ca"])
def test_a_failed_start_names_the_flag_and_hides_the_password(tiny_model, tls_redis,
                                                                change, why):
    r = run_command(harness.mlx_lm_server_cmd(tiny_model, harness.free_port(),
                                              "--kv-cache-remote", change(tls_redis.url)),
                    timeout=90)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert why in out and "--kv-cache-remote" in out and "KVPLUGIN_KV_CACHE_REMOTE" in out
    assert PASSWORD not in out and "Starting httpd" not in out
