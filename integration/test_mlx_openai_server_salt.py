"""A request's ``cache_salt`` isolates its prefixes on a real ``mlx-openai-server launch``, in
every tier, on both of its paths.

Same long system prompt: salt "a" computes it, salt "b" reuses nothing (``cached_tokens`` 0),
salt "a" again reuses it, and requests without a salt reuse each other's as before, on the
batched path (one hot entry: the rest spill to its SSD tier) and the single-request path.
Through a real redis-server, replica 2 (``--kv-cache-require-salt``) misses salt "a"'s
published prefix with salt "b", hits it with salt "a", and answers a request without a salt
400, naming the field. On disk the salts' entries live under different names, neither salt in
clear.
"""

from __future__ import annotations

import time

import harness
import pytest
from harness import answer_text, cached_tokens, mlx_openai_server_cmd

from kvplugin.tools.client import stream_chat

MAX_TOKENS = 4
SALT_A, SALT_B = "salt-a-5e21c07d", "salt-b-93f0b6a4"


@pytest.fixture(scope="module")
def ssd(tmp_path_factory):
    return tmp_path_factory.mktemp("salt") / "prompt-cache"


@pytest.fixture(scope="module")
def replicas(start_server, redis_server, ssd):
    remote = ("--kv-cache-remote", redis_server.url)
    return (start_server(mlx_openai_server_cmd, *remote, "--prompt-cache-dir", str(ssd),
                         "--prompt-cache-size", "1"),
            start_server(mlx_openai_server_cmd, *remote, "--kv-cache-require-salt"))


def _ask(srv, system, question, salt=None):
    extra = {} if salt is None else {"cache_salt": salt}
    return srv.chat([system, {"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                    **extra)


def test_two_salts_never_share_a_prefix_and_no_salt_reuses_as_before(replicas, ssd):
    srv, _ = replicas
    system = harness.briefing(50)
    a1 = _ask(srv, system, "Tell me about the bridge.", SALT_A)
    assert cached_tokens(a1) == 0
    b1 = _ask(srv, system, "Tell me about the bridge.", SALT_B)
    assert cached_tokens(b1) == 0, b1["usage"]  # salt a's prefix is not salt b's
    assert answer_text(b1) == answer_text(a1)  # the same answer, computed again
    a2 = _ask(srv, system, "When does the bakery open?", SALT_A)
    prompt = a2["usage"]["prompt_tokens"]
    assert cached_tokens(a2) >= prompt // 2, a2["usage"]  # salt a reuses its own (from SSD)
    n1 = _ask(srv, system, "Who repaired the bridge?")
    assert cached_tokens(n1) < prompt // 4, n1["usage"]  # nor does a request without a salt
    n2 = _ask(srv, system, "Where do the buses go?")
    assert cached_tokens(n2) >= prompt // 2, n2["usage"]  # without a salt: reuse as before
    salt_c = [stream_chat(srv, [system, {"role": "user", "content": question}],
                          max_tokens=MAX_TOKENS, cache_salt="salt-c-streamed")
              for question in ("And the ferry?", "And the trams?")]  # streamed, a new salt
    assert salt_c[0].cached_tokens < prompt // 4, salt_c[0]  # its own namespace: empty
    assert salt_c[1].cached_tokens >= prompt // 2, salt_c[1]  # then its own prefix
    stats = srv.get("/kvplugin/stats")
    assert stats["store_cold_hits"] >= 1, stats
    assert "could not be matched" not in srv.log_text()  # every call's request was known
    deadline = time.monotonic() + 10
    while len({p.parent.name for p in ssd.rglob("*.safetensors")}) < 3:
        assert time.monotonic() < deadline, sorted(ssd.rglob("*"))
        time.sleep(0.05)
    for path in ssd.rglob("*"):  # salt a, salt b and no salt: three names, no salt in clear
        assert SALT_A not in str(path) and SALT_B not in str(path)
        if path.is_file():
            data = path.read_bytes()
            assert SALT_A.encode() not in data and SALT_B.encode() not in data


def test_the_single_request_path_keeps_salts_apart(start_server):
    srv = start_server(mlx_openai_server_cmd, "--disable-batching")
    system = harness.briefing(52)
    a1 = _ask(srv, system, "Tell me about the mill.", SALT_A)
    b1 = _ask(srv, system, "Tell me about the mill.", SALT_B)
    assert cached_tokens(b1) == 0, b1["usage"]
    assert answer_text(b1) == answer_text(a1)
    a2 = _ask(srv, system, "Who owns it?", SALT_A)
    prompt = a2["usage"]["prompt_tokens"]
    assert cached_tokens(a2) >= prompt // 2, a2["usage"]
    assert cached_tokens(_ask(srv, system, "Who built it?")) < prompt // 4
    n2 = _ask(srv, system, "Who works there?")
    assert cached_tokens(n2) >= prompt // 2, n2["usage"]
    assert "could not be matched" not in srv.log_text()


def test_a_salted_prefix_crosses_redis_for_its_salt_only(replicas, redis_server):
    one, two = replicas
    harness.check_salt_crosses_redis(one, two, redis_server, _ask, harness.briefing(51),
                                     SALT_A, SALT_B)
    assert "could not be matched" not in two.log_text()


def test_a_request_without_a_salt_is_refused_where_one_is_required(replicas):
    _, strict = replicas
    body = {"model": harness.SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for payload in (body, {**body, "cache_salt": ""}, {**body, "cache_salt": 7}):
        status, out = strict.request("POST", "/v1/chat/completions", payload)
        assert status == 400 and "cache_salt" in str(out), (payload, status, out)
    assert answer_text(strict.chat("hello", max_tokens=2, cache_salt=SALT_A))
