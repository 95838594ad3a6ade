"""``--max-kv-size`` entries reach every cold tier on a real ``mlx_lm.server``.

A bounded entry (``PreallocatedRotatingKVCache`` layers, wrapped past the bound) spills to
``--ssd-cache-dir`` and is a cold hit for a new server on the same directory; through
``--kv-cache-remote`` it is a hit on a second replica. Either way the continuation answers
exactly as a server with the same flags and no tier (fp16); below the bound, in memory, it
shares its prefix. A layer a tier cannot hold (a plugin's own cache class) is said once,
naming the class and why, and counted by reason.
"""

from __future__ import annotations

import json
import time

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin import cli

N = "256"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference(start_server):
    """The same bound, no tier: what every continuation must answer."""
    return start_server(harness.mlx_lm_server_cmd, "--max-kv-size", N)


def _turns(i: int) -> tuple[list, str]:
    first = [harness.briefing(i), {"role": "user", "content": "Tell me about the bridge."}]
    return first, "And what happened next?"


def _second(first: list, answer: str, follow_up: str) -> list:
    return first + [{"role": "assistant", "content": answer},
                    {"role": "user", "content": follow_up}]


def _wait(srv, ready, timeout: float = 15.0) -> dict:
    """The stats once ``ready(stats)``: mlx-lm answers before it stores."""
    deadline = time.monotonic() + timeout
    while not ready(stats := srv.get("/kvplugin/stats")):
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def test_a_bounded_entry_spills_and_is_a_cold_hit_after_a_restart(
        start_server, reference, tmp_path_factory):
    tier = tmp_path_factory.mktemp("bounded") / "kv"
    flags = ("--max-kv-size", N, "--ssd-cache-dir", str(tier), "--prompt-cache-bytes", "1")
    first, follow_up = _turns(0)
    want_first = reference.chat(first, max_tokens=MAX_TOKENS, seed=3)  # sequential route
    assert want_first["usage"]["prompt_tokens"] > int(N)
    second = _second(first, answer_text(want_first), follow_up)
    want_second = reference.chat(second, max_tokens=MAX_TOKENS, seed=3)

    before = start_server(harness.mlx_lm_server_cmd, *flags)
    assert answer_text(before.chat(first, max_tokens=MAX_TOKENS, seed=3)) == answer_text(
        want_first)
    # the cold tier counts its write before the store counts the spill: wait for both
    stats = _wait(before, lambda s: s["cold_puts"] >= 1 and s["store_spills"] >= 1)
    assert stats["cold_refused"] == 0, stats["cold_tier"]
    assert stats["cold_tier"]["refused_by_reason"] == {}
    assert before.stop() is not None
    assert list(tier.rglob("*.safetensors"))

    after = start_server(harness.mlx_lm_server_cmd, *flags)
    assert after.get("/kvplugin/stats")["store_cold_entries"] >= 1
    got = after.chat(second, max_tokens=MAX_TOKENS, seed=3)
    assert cached_tokens(got) > int(N), got["usage"]  # a wrapped entry, reused by move
    assert answer_text(got) == answer_text(want_second)  # fp16: as if never stored
    assert after.get("/kvplugin/stats")["store_cold_hits"] >= 1


@pytest.fixture(scope="module")
def replicas(start_server, redis_server):
    flags = ("--max-kv-size", N, "--kv-cache-remote", redis_server.url)
    return [start_server(harness.mlx_lm_server_cmd, *flags) for _ in range(2)]


@pytest.mark.parametrize("seed", [None, 5], ids=["batched", "sequential"])
def test_a_bounded_entry_is_a_hit_on_a_second_replica_through_redis(reference, replicas, seed):
    a, b = replicas
    first, follow_up = _turns(1 if seed is None else 2)
    want_first = reference.chat(first, max_tokens=MAX_TOKENS, seed=seed)
    second = _second(first, answer_text(want_first), follow_up)
    want_second = reference.chat(second, max_tokens=MAX_TOKENS, seed=seed)

    puts = a.get("/kvplugin/stats")["remote_puts"]
    assert answer_text(a.chat(first, max_tokens=MAX_TOKENS, seed=seed)) == answer_text(
        want_first)
    stats = harness.wait_published(a, puts + 1)
    assert stats["remote_refused"] == 0, stats["cold_tier"]
    assert stats["cold_tier"]["remote_refused_by_reason"] == {}
    got = b.chat(second, max_tokens=MAX_TOKENS, seed=seed)
    assert cached_tokens(got) > int(N), got["usage"]
    assert answer_text(got) == answer_text(want_second)
    assert b.get("/kvplugin/stats")["remote_hits"] >= 1


@pytest.mark.parametrize("seed", [None, 7], ids=["batched", "sequential"])
def test_a_bounded_entry_below_its_bound_shares_its_prefix_in_memory(reference, seed):
    """An entry that has not reached the bound can be cut: another question after the same
    system prompt reuses it (its undo log does not make it uncopyable)."""
    system = {"role": "system", "content": "You guide visitors through a small town with a "
              f"bridge, a bakery and a market ({seed}). Answer briefly, in plain words."}
    reference.chat([system, {"role": "user", "content": "Tell me about the bridge."}],
                   max_tokens=4, seed=seed)
    r = reference.chat([system, {"role": "user", "content": "When does the bakery open?"}],
                       max_tokens=4, seed=seed)
    assert r["usage"]["prompt_tokens"] < int(N)
    assert cached_tokens(r) >= r["usage"]["prompt_tokens"] // 2, r["usage"]


@pytest.fixture
def tagging_plugin(tmp_path) -> dict[str, str]:
    """Env installing a plugin (a real entry point) whose caches are a class of its own with
    live state no tier can store (a list)."""
    return harness.plugin_on_path(tmp_path, "tagged", (
        "from mlx_lm.models.cache import KVCache\n"
        "from kvplugin.hookspecs import hookimpl\n\n"
        "class TaggedKVCache(KVCache):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.notes = []\n\n"
        "@hookimpl\n"
        "def kvplugin_make_cache(model, cache, settings):\n"
        "    return [TaggedKVCache() for _ in cache]\n"
    ))


def test_a_layer_the_tier_cannot_hold_is_said_once_and_counted_by_reason(
        start_server, tagging_plugin, tmp_path, capsys):
    srv = start_server(harness.mlx_lm_server_cmd, "--ssd-cache-dir", str(tmp_path / "kv"),
                       "--prompt-cache-bytes", "1", env=tagging_plugin)
    for i in range(2):
        srv.chat([harness.briefing(3 + i), {"role": "user", "content": "Hello?"}],
                 max_tokens=2, seed=1)
    stats = _wait(srv, lambda s: s["cold_refused"] >= 2)
    assert stats["cold_tier"]["refused_by_reason"] == {
        "unsupported:TaggedKVCache": stats["cold_refused"]}, stats["cold_tier"]
    assert stats["cold_puts"] == 0
    lines = [line for line in srv.log_text().splitlines()
             if line.startswith("kvplugin:") and "TaggedKVCache" in line]
    assert len(lines) == 1, lines
    assert "stores no entry" in lines[0] and "notes" in lines[0]
    capsys.readouterr()
    assert cli.main(["info", "--server", srv.url, "--json"]) == 0
    refusals = json.loads(capsys.readouterr().out)["refusals"]
    assert refusals["cold_tier"] == stats["cold_tier"]["refused_by_reason"]
    assert refusals["remote_tier"] is None  # no remote tier configured
