"""Two real ``mlx_lm.server`` replicas share one real ``redis-server`` (``--kv-cache-remote``).

A long prefix sent to replica A is a hit on replica B, which reuses at least as many prompt
tokens as a single stock server that saw both requests, and answers exactly as stock does, on
both serving paths. Faults: a corrupted value (``redis-cli``) is a counted miss, Redis stopped
mid-run leaves both replicas answering, a second model on the same Redis never gets the first
one's entries, a wrong password stops the server before it listens, naming flag and env.
"""

from __future__ import annotations

import subprocess
import time

import harness
import pytest
from harness import answer_text, cached_tokens, run_command
from prometheus_client.parser import text_string_to_metric_families

from kvplugin.cache.tiers.remote_keys import PREFIX
from kvplugin.tools.models.tiny import build_tiny_model
from kvplugin.tools.redisproc import RedisServer

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stock(start_server):
    return start_server(harness.mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"})


@pytest.fixture(scope="module")
def replicas(start_server, redis_server):
    return [start_server(harness.mlx_lm_server_cmd, "--kv-cache-remote", redis_server.url)
            for _ in range(2)]


@pytest.mark.parametrize("seed", [None, 1], ids=["batched", "sequential"])
def test_a_prefix_computed_by_one_replica_is_reused_by_the_other(stock, replicas, seed):
    a, b = replicas
    system = harness.briefing(0 if seed is None else 1)
    first = [system, {"role": "user", "content": "Tell me about the bridge."}]
    second = [system, {"role": "user", "content": "When does the bakery open?"}]
    stock_first = stock.chat(first, max_tokens=MAX_TOKENS, seed=seed)
    stock_second = stock.chat(second, max_tokens=MAX_TOKENS, seed=seed)
    puts = a.get("/kvplugin/stats")["remote_puts"]
    a_first = a.chat(first, max_tokens=MAX_TOKENS, seed=seed)
    harness.wait_published(a, puts + 1)
    b_second = b.chat(second, max_tokens=MAX_TOKENS, seed=seed)
    prompt = b_second["usage"]["prompt_tokens"]
    assert answer_text(a_first) == answer_text(stock_first)
    assert answer_text(b_second) == answer_text(stock_second)  # fp16: identical to stock
    # B never saw this prompt; it reused A's work, at least as much as one stock server
    # that saw both requests itself.
    assert cached_tokens(b_second) >= max(cached_tokens(stock_second), 0.5 * prompt), (
        cached_tokens(b_second), cached_tokens(stock_second), prompt)
    stats = b.get("/kvplugin/stats")
    assert stats["remote_hits"] >= 1 and stats["remote_bytes_read"] > 0, stats
    assert stats["remote_connected"] == 1 and stats["remote_url"] == a.get(
        "/kvplugin/stats")["remote_url"]
    status, text = b.request("GET", "/metrics")
    assert status == 200
    series = {s.name: s.value for fam in text_string_to_metric_families(str(text))
              for s in fam.samples}
    assert series["kvplugin_remote_hits_total"] == stats["remote_hits"]
    assert series["kvplugin_remote_read_bytes_total"] == stats["remote_bytes_read"]
    assert series["kvplugin_remote_connected"] == 1


def test_a_corrupted_value_is_a_counted_miss_never_served(stock, replicas, redis_server):
    a, b = replicas
    system = harness.briefing(2)
    first = [system, {"role": "user", "content": "Describe the morning mist."}]
    second = [system, {"role": "user", "content": "Where do the buses go?"}]
    puts = a.get("/kvplugin/stats")["remote_puts"]
    a.chat(first, max_tokens=MAX_TOKENS)
    harness.wait_published(a, puts + 1)
    cli = ["redis-cli", "-h", "127.0.0.1", "-p", str(redis_server.port)]
    keys = subprocess.run([*cli, "--scan", "--pattern", f"{PREFIX}:*:e:*"], check=True,
                          capture_output=True, text=True).stdout.split()
    assert keys
    for key in keys:  # garbage inside every value's tensor data
        subprocess.run([*cli, "SETRANGE", key, "4000", "garbage-garbage"], check=True,
                       capture_output=True)
    before = b.get("/kvplugin/stats")
    r = b.chat(second, max_tokens=MAX_TOKENS)
    after = b.get("/kvplugin/stats")
    assert answer_text(r) == answer_text(stock.chat(second, max_tokens=MAX_TOKENS))
    remote = {k: (before[k], v) for k, v in after.items() if k.startswith("remote_")}
    assert after["remote_corrupt"] > before["remote_corrupt"], remote
    assert after["remote_hits"] == before["remote_hits"], remote
    # at most the chat template's first tokens, from B's own hot tier
    assert (cached_tokens(r) or 0) < r["usage"]["prompt_tokens"] // 4


def test_redis_stopped_mid_run_leaves_both_replicas_answering(stock, replicas, redis_server):
    a, b = replicas
    system = harness.briefing(3)
    redis_server.stop()
    try:
        for i, srv in enumerate((a, b, a, b)):
            messages = [system, {"role": "user", "content": f"Question {i}: who lives here?"}]
            started = time.monotonic()
            r = srv.chat(messages, max_tokens=MAX_TOKENS)
            assert time.monotonic() - started < 30
            assert answer_text(r) == answer_text(stock.chat(messages, max_tokens=MAX_TOKENS))
        for srv in (a, b):
            stats = srv.get("/kvplugin/stats")
            assert stats["remote_connected"] == 0, stats
            assert stats["remote_errors"] + stats["remote_dropped"] >= 1, stats
            assert srv.log_text().count("unavailable") == 1  # one warning, not one per request
    finally:
        redis_server.start()


def test_a_second_model_on_the_same_redis_never_gets_the_first_ones_entries(
        start_server, replicas, redis_server, tmp_path_factory):
    a, _ = replicas
    system = harness.briefing(4)
    messages = [system, {"role": "user", "content": "What is sold on market days?"}]
    deadline = time.monotonic() + 30
    while a.get("/kvplugin/stats")["remote_connected"] != 1:  # back from the previous test
        a.chat([harness.briefing(5), {"role": "user", "content": "ping"}], max_tokens=1)
        assert time.monotonic() < deadline
        time.sleep(0.5)
    puts = a.get("/kvplugin/stats")["remote_puts"]
    a.chat(messages, max_tokens=MAX_TOKENS)
    harness.wait_published(a, puts + 1)
    other = build_tiny_model(tmp_path_factory.mktemp("other-model"), seed=1)
    c = start_server(harness.mlx_lm_server_cmd, "--kv-cache-remote", redis_server.url,
                     model_dir=other)
    r = c.chat(messages, max_tokens=MAX_TOKENS)
    stats = c.get("/kvplugin/stats")
    assert stats["remote_hits"] == 0 and stats["remote_corrupt"] == 0, stats
    assert (cached_tokens(r) or 0) < r["usage"]["prompt_tokens"] // 4


def test_a_wrong_password_stops_the_server_before_it_listens(tiny_model):
    with RedisServer(password="right") as server:
        url = server.url.replace(":right@", ":wrong@")
        r = run_command(harness.mlx_lm_server_cmd(tiny_model, harness.free_port(),
                                                  "--kv-cache-remote", url), timeout=90)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "--kv-cache-remote" in out and "KVPLUGIN_KV_CACHE_REMOTE" in out, out[-2000:]
    assert "Starting httpd" not in out and ":wrong@" not in out


def test_hot_cache_only_turns_the_remote_tier_off_and_says_so(start_server, redis_server):
    srv = start_server(harness.mlx_lm_server_cmd, "--kv-cache-remote", redis_server.url,
                       "--hot-cache-only")
    keys = len(redis_server.client().keys(f"{PREFIX}:*"))
    r = srv.chat([harness.briefing(6), {"role": "user", "content": "Who repaired the bridge?"}],
                 max_tokens=MAX_TOKENS)
    assert answer_text(r)
    time.sleep(0.5)
    stats = srv.get("/kvplugin/stats")
    assert stats["remote_url"] is None and stats["remote_puts"] is None, stats
    assert stats["store_entries"] >= 1  # the hot tier still works
    assert len(redis_server.client().keys(f"{PREFIX}:*")) == keys  # nothing left the process
    assert srv.log_text().count("--hot-cache-only wins: the remote tier") == 1
