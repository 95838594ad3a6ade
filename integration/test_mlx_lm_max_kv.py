"""``--max-kv-size N``: requests longer than N work on both paths and every cache is bounded;
the start-up log says what the batched path can and cannot honour."""

from __future__ import annotations

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools.models.corpus import CORPUS

N = 64
TOKEN_BYTES = 1024
WORDS = CORPUS.split()
LONG = " ".join(WORDS[:120])  # ~160 tokens > N
BOUNDED = {"RotatingKVCache", "PreallocatedRotatingKVCache"}


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(harness.mlx_lm_server_cmd, env={"KVPLUGIN_MAX_KV_SIZE": str(N)})


def test_startup_says_what_is_bounded(srv):
    log = srv.log_text()
    assert f"max-kv-size: {N} tokens" in log
    # changed on purpose: batched requests keep the first tokens (kvplugin's batch cache), and
    # the line says so
    assert f"--max-kv-size {N}: every request gets" in log
    assert "KeepingBatchRotatingKVCache" in log and "one at a time" not in log


def test_same_answer_on_both_routes(srv):
    """Greedy: without a seed (mlx-lm's batched route) = with a seed (its sequential route)."""
    messages = [{"role": "user", "content": LONG + " (routes)"}]
    a = srv.chat(messages, max_tokens=12)
    b = srv.chat(messages, max_tokens=12, seed=11)
    assert a["usage"]["prompt_tokens"] > N
    assert answer_text(a) == answer_text(b)


@pytest.mark.parametrize("seed", [None, 4], ids=["batched", "sequential"])
def test_long_requests_work_and_caches_are_bounded(srv, seed):
    messages = [{"role": "user", "content": LONG + f" ({seed})"}]
    first = srv.chat(messages, max_tokens=8, seed=seed)
    assert first["usage"]["prompt_tokens"] > N
    assert answer_text(first).strip()
    # a second turn continues the conversation from the stored (rotating) entry
    messages += [{"role": "assistant", "content": answer_text(first)},
                 {"role": "user", "content": "And then?"}]
    second = srv.chat(messages, max_tokens=8, seed=seed)
    assert answer_text(second).strip()
    # changed on purpose: on every route the entry is stored at its prompt boundary (the
    # sequential route rewinds its answer with the undo log): a rotating entry that has
    # wrapped (more than N tokens) and is reused by move for the continuation
    assert cached_tokens(second) > N, second["usage"]
    stats = srv.get("/kvplugin/stats")
    assert stats["max_kv_size"] == N
    assert stats["caches_bounded"] >= 1 and stats["caches_bounded"] <= stats["caches_made"]
    assert stats["entries"]
    for e in stats["entries"]:
        assert e["tokens"] > N, e
        assert set(e["layers"]) <= BOUNDED, e
        assert e["nbytes"] <= N * TOKEN_BYTES, e  # N tokens at most, whatever the length
