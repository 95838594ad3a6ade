"""The remote tier (kvplugin.cache.tiers.remote) against a real redis-server on 127.0.0.1.

No mock: timeouts, a server that stops, a corrupted value and the number of round trips are
properties of a real Redis. A machine without ``redis-server`` fails here, saying how to
install it (``bash .ci/run`` does).
"""

from __future__ import annotations

import logging
import os
import signal
import time

import mlx.core as mx
import pytest
import redis
from mlx_lm.models.cache import ArraysCache, KVCache

from kvplugin.cache.service.service import store_key
from kvplugin.cache.tiers.remote import RemoteTier
from kvplugin.cache.tiers.remote_keys import PREFIX, namespace_of
from kvplugin.settings import SettingsError
from kvplugin.tools.redisproc import RedisServer

BLOCK = 64
MODEL = "mlx-lm|fp-abc|max_kv=0"


def _entry(tokens: int, seed: int = 0) -> list:
    mx.random.seed(seed)
    layer = KVCache()
    k = mx.random.normal((1, 2, tokens, 64)).astype(mx.float16)
    layer.update_and_fetch(k, k * 2)
    return [layer]


def _published(t: RemoteTier, n: int = 1) -> None:
    deadline = time.monotonic() + 10
    while t.stats()["remote_puts"] < n:
        assert time.monotonic() < deadline, t.stats()
        time.sleep(0.01)


def _commands(server, name: str) -> int:
    stats = server.client().info("commandstats")
    return stats.get(f"cmdstat_{name}", {}).get("calls", 0)


def test_an_entry_published_by_one_tier_is_a_hit_on_another(tier, redis_server):
    a, b = tier(), tier()
    tokens = list(range(1000, 1300))
    cache = _entry(300)
    assert a.publish(MODEL, tokens, cache)
    _published(a)
    got = b.fetch(MODEL, tokens + [7, 8, 9])
    assert got is not None
    out, n = got
    assert n == 300
    assert mx.array_equal(out[0].keys[..., :300, :], cache[0].keys[..., :300, :]).item()
    assert b.stats()["remote_hits"] == 1 and b.stats()["remote_bytes_read"] > 300 * 256
    keys = redis_server.client().keys(f"{PREFIX}:*")
    assert len(keys) == 1 + 300 // BLOCK  # the value and a pointer set per block end
    for key in keys:  # everything written expires
        assert 0 < redis_server.client().ttl(key) <= 3600


@pytest.mark.parametrize("codec,bits", [("rotated-channel", 4), ("rotated-channel-sym", 3)])
def test_a_quantized_entry_crosses_redis_with_its_codec_record(tier, codec, bits):
    """Another replica reads the stored codes and the codec's record back unchanged (the
    same full-precision rows, per-channel key groups, scale-only values) and restores
    exactly what the publishing replica would have; a shorter prompt gets a prefix of it."""
    from kvplugin.cache.codec.quantize import CODEC_ATTR, dequantize_entry, quantize_entry

    a, b = tier(entry_format=codec), tier(entry_format=codec)
    tokens = list(range(2000, 2300))
    q = quantize_entry(_entry(300, seed=4), bits=bits, group_size=64, codec=codec,
                       sink_tokens=4, recent_tokens=16, prompt_boundaries=[200]).cache
    assert a.publish(MODEL, tokens, q)
    _published(a)
    want = dequantize_entry(q)[0]
    for m in (300, 200):
        got = b.fetch(MODEL, tokens[:m] + [5])
        assert got is not None and got[1] == m
        assert getattr(got[0][0], CODEC_ATTR) == codec
        back = dequantize_entry(got[0])[0]
        assert mx.array_equal(back.keys[..., :m, :], want.keys[..., :m, :]).item()
        assert mx.array_equal(back.values[..., :m, :], want.values[..., :m, :]).item()


def test_a_shared_prefix_is_found_in_two_round_trips_and_cut_to_every_common_token(
        tier, redis_server, monkeypatch):
    a, b = tier(), tier()
    system = list(range(5000, 5000 + 4 * BLOCK + 10))  # 4 blocks and a bit
    a.publish(MODEL, system + [1, 2, 3], _entry(len(system) + 3))
    _published(a)
    sent = []
    real = redis.connection.AbstractConnection.send_packed_command
    mine = set()
    for client in (b._lookup, b._values):
        client.ping()  # connected: the hand-shake is not the lookup's
        mine.update(id(c) for c in client.connection_pool._available_connections)

    def send(conn, command, check_health=True):  # one call: one round trip
        if id(conn) in mine:
            sent.append(command)
        return real(conn, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    before = _commands(redis_server, "zrevrange"), _commands(redis_server, "get")
    got = b.fetch(MODEL, system + [8] * 4000)  # a 4k-token prompt: still two round trips
    after = _commands(redis_server, "zrevrange"), _commands(redis_server, "get")
    monkeypatch.undo()
    assert got is not None and got[1] == len(system)  # every common token, not whole blocks
    assert got[0][0].offset == len(system)
    assert len(sent) == 2, sent  # every pointer set in one pipeline, then the value
    assert (after[0] - before[0], after[1] - before[1]) == ((len(system) + 4000) // BLOCK, 1)


def test_other_models_formats_and_short_prefixes_never_match(tier):
    a = tier()
    tokens = list(range(400))
    a.publish(MODEL, tokens, _entry(400))
    _published(a)
    assert tier(entry_format="affine:k8v8").fetch(MODEL, tokens) is None
    assert tier().fetch("mlx-lm|fp-other|max_kv=0", tokens) is None
    assert tier().fetch("mlx-lm|fp-abc|max_kv=512", tokens) is None
    assert tier().fetch(MODEL, [7] + tokens) is None  # differs before the first block ends
    assert tier().fetch(MODEL, tokens[:BLOCK - 1]) is None
    # the host is not part of the shared key: mlx-lm and vllm-mlx replicas share entries
    assert tier().fetch("vllm-mlx|fp-abc|max_kv=0", tokens) is not None
    assert (namespace_of(store_key("mlx-lm", "fp", None), "full")
            == namespace_of(store_key("vllm-mlx", "fp", None), "full"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_value_is_a_counted_miss_and_is_deleted(tier, redis_server, damage, caplog):
    a, b = tier(), tier()
    tokens = list(range(200))
    a.publish(MODEL, tokens, _entry(200))
    _published(a)
    r = redis_server.client()
    key = r.keys(f"{PREFIX}:*:e:*")[0]
    raw = r.get(key)
    if damage == "flip":
        r.setrange(key, len(raw) - 100, b"\xff" * 8)
    elif damage == "truncate":
        r.set(key, raw[: len(raw) // 2])
    else:
        import pickle

        r.set(key, pickle.dumps({"keys": [1, 2, 3]}))
    with caplog.at_level(logging.WARNING, logger="kvplugin.cache"):
        assert b.fetch(MODEL, tokens) is None
    s = b.stats()
    assert s["remote_corrupt"] == 1 and s["remote_hits"] == 0, s
    assert "is not used" in caplog.text
    deadline = time.monotonic() + 5
    while r.exists(key):  # the writer thread deletes it
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_value_over_the_size_bound_is_neither_written_nor_read(tier, redis_server):
    small = tier(max_value_bytes=10_000)
    assert not small.publish(MODEL, list(range(200)), _entry(200))
    assert small.stats()["remote_too_large"] == 1
    big = tier()
    big.publish(MODEL, list(range(200)), _entry(200))
    _published(big)
    assert small.fetch(MODEL, list(range(200))) is None
    s = small.stats()  # refused by the size its pointer carries: never downloaded
    assert s["remote_too_large"] == 2 and s["remote_bytes_read"] == 0, s


def test_recurrent_state_is_reused_only_by_prompts_that_extend_it(tier):
    a = tier()
    layer = ArraysCache(2)
    layer[0] = mx.ones((1, 3, 8))
    layer[1] = mx.ones((1, 4, 16))
    tokens = list(range(150))
    a.publish(MODEL, tokens, [layer])
    _published(a)
    assert tier().fetch(MODEL, tokens[:140] + [1] * 50) is None  # would need a cut
    got = tier().fetch(MODEL, tokens + [1] * 50)
    assert got is not None and got[1] == 150


def test_redis_down_is_a_fast_miss_with_one_warning_then_it_reconnects(tier, redis_server,
                                                                        caplog):
    a = tier(fetch_timeout_ms=300)
    tokens = list(range(300))
    a.publish(MODEL, tokens, _entry(300))
    _published(a)
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="kvplugin.cache"):
            for _ in range(5):
                started = time.monotonic()
                assert a.fetch(MODEL, tokens) is None
                assert time.monotonic() - started < 0.3 + 0.5
                assert not a.publish(MODEL, list(range(1, 301)), _entry(300))
        assert caplog.text.count("unavailable") == 1, caplog.text
        s = a.stats()
        assert s["remote_connected"] == 0 and s["remote_errors"] >= 1, s
        assert s["remote_dropped"] >= 1, s
    finally:
        redis_server.start()
    deadline = time.monotonic() + 5
    got = None
    while got is None:  # back-off over: the next fetch tries again (the data is gone)
        a.publish(MODEL, tokens, _entry(300, seed=1))
        got = a.fetch(MODEL, tokens)
        assert time.monotonic() < deadline, a.stats()
        time.sleep(0.1)
    assert a.stats()["remote_connected"] == 1


def test_a_slow_redis_costs_a_request_at_most_the_fetch_timeout(tier, redis_server):
    a = tier(fetch_timeout_ms=150)
    tokens = list(range(300))
    a.publish(MODEL, tokens, _entry(300))
    _published(a)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # a Redis that stops answering
    try:
        started = time.monotonic()
        assert a.fetch(MODEL, tokens) is None
        waited = time.monotonic() - started
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert waited < 0.15 + 0.5, waited  # the deadline, plus a loaded CI machine's slack
    assert a.stats()["remote_timeouts"] + a.stats()["remote_errors"] >= 1


def test_a_wrong_password_is_a_start_up_error_naming_flag_and_env():
    with RedisServer(password="right") as server:
        url = server.url.replace(":right@", ":wrong@")
        with pytest.raises(SettingsError) as err:
            RemoteTier(url, entry_format="full")
        text = str(err.value)
        assert "--kv-cache-remote" in text and "KVPLUGIN_KV_CACHE_REMOTE" in text
        assert "wrong" not in text  # the password is never printed
        ok = RemoteTier(server.url, entry_format="full")
        assert ok.stats()["remote_connected"] == 1
        ok.close()


def test_an_entry_that_does_not_fit_the_model_is_never_served_and_is_deleted(tier,
                                                                             redis_server):
    from kvplugin.cache.store.prompt_store import PromptStore

    a = tier()
    tokens = list(range(300))
    a.publish(MODEL, tokens, _entry(300))
    _published(a)
    b = tier()
    store = PromptStore(max_bytes=1 << 30, cold=b)
    cache, n = store.fetch(MODEL, tokens + [1], check=lambda c: False)  # the model refuses it
    assert cache is None and n == 0
    assert b.stats()["remote_invalid"] == 1
    deadline = time.monotonic() + 5
    while redis_server.client().keys(f"{PREFIX}:*:e:*"):  # deleted by the writer thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cache, n = store.fetch(MODEL, tokens + [1], check=lambda c: True)
    assert cache is None  # gone for every replica, not only this one


def test_a_full_redis_refuses_writes_with_a_warning_and_serving_goes_on(caplog):
    with RedisServer(maxmemory="2mb", policy="noeviction") as server:
        t = RemoteTier(server.url, entry_format="full", block_tokens=BLOCK)
        try:
            with caplog.at_level(logging.WARNING, logger="kvplugin.cache"):
                assert t.publish(MODEL, list(range(12000)), _entry(12000))  # ~3 MB
                deadline = time.monotonic() + 10
                while t.stats()["remote_errors"] < 1:
                    assert time.monotonic() < deadline, t.stats()
                    time.sleep(0.01)
                assert t.fetch(MODEL, list(range(12000))) is None
            s = t.stats()
            assert s["remote_puts"] == 0 and s["remote_connected"] == 1, s  # full, not down
            assert "OOM" in caplog.text or "maxmemory" in caplog.text, caplog.text
        finally:
            t.close()


def test_a_unix_socket_url_serves_like_tcp():
    with RedisServer(unix_socket=True) as server:
        assert server.url.startswith("unix://")
        a = RemoteTier(server.url, entry_format="full", block_tokens=BLOCK)
        b = RemoteTier(server.url, entry_format="full", block_tokens=BLOCK)
        try:
            assert a.publish(MODEL, list(range(200)), _entry(200))
            _published(a)
            got = b.fetch(MODEL, list(range(200)) + [5])
            assert got is not None and got[1] == 200
        finally:
            a.close()
            b.close()
