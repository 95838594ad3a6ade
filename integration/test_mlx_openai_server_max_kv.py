"""``--max-kv-size N`` on ``mlx-openai-server launch``: requests longer than N work on its
batched and single-request paths, every stored entry is bounded and reused, and both paths
answer alike (the criterion of the mlx-lm host's ``--max-kv-size`` tests)."""

from __future__ import annotations

import pytest
from harness import answer_text, cached_tokens, mlx_openai_server_cmd

from kvplugin.tools.models.corpus import CORPUS

N = 64
TOKEN_BYTES = 1024  # the tiny model's fp16 keys and values per token, all layers
LONG = " ".join(CORPUS.split()[:120])  # ~160 tokens > N
BOUNDED = {"RotatingKVCache", "PreallocatedRotatingKVCache"}


@pytest.fixture(scope="module")
def batched(start_server):
    return start_server(mlx_openai_server_cmd, "--max-kv-size", str(N))


@pytest.fixture(scope="module")
def single(start_server):
    return start_server(mlx_openai_server_cmd, "--disable-batching",
                        env={"KVPLUGIN_MAX_KV_SIZE": str(N)})


def test_the_flag_reaches_the_model_process(batched):
    assert f"max-kv-size: {N} tokens" in batched.log_text()


@pytest.mark.parametrize("path", ["batched", "single"])
def test_long_requests_store_bounded_entries_and_reuse_them(request, path):
    srv = request.getfixturevalue(path)
    messages = [{"role": "user", "content": LONG}]
    first = srv.chat(messages, max_tokens=8)
    assert first["usage"]["prompt_tokens"] > N
    assert answer_text(first).strip()
    messages += [{"role": "assistant", "content": answer_text(first)},
                 {"role": "user", "content": "And then?"}]
    second = srv.chat(messages, max_tokens=8)
    assert answer_text(second).strip()
    assert cached_tokens(second) > N, second["usage"]  # a wrapped rotating entry, reused
    stats = srv.get("/kvplugin/stats")
    assert stats["max_kv_size"] == N
    assert 1 <= stats["caches_bounded"] <= stats["caches_made"], stats
    assert stats["store_hits"] >= 1 and stats["entries"], stats
    for e in stats["entries"]:
        assert e["tokens"] > N, e
        assert set(e["layers"]) <= BOUNDED, e
        assert e["nbytes"] <= N * TOKEN_BYTES, e  # N tokens at most, whatever the length


def test_both_paths_answer_alike(batched, single):
    messages = [{"role": "user", "content": LONG + " (paths)"}]
    a, b = batched.chat(messages, max_tokens=12), single.chat(messages, max_tokens=12)
    assert a["usage"]["prompt_tokens"] > N
    assert answer_text(a) == answer_text(b)
