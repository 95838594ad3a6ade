"""A request's ``cache_salt`` isolates its prefixes on real ``vllm-mlx serve`` processes.

Default mode and ``--continuous-batching``: same long system prompt, salt "a" computes it,
salt "b" reuses nothing, salt "a" again reuses it, and requests without a salt reuse each
other's as before. Through a real redis-server, a prefix one replica published with salt "a"
is a miss for salt "b" and a hit for salt "a" on another. ``--kv-cache-require-salt``: a
request without one is answered 400, naming the field. vllm-mlx reports no
``cached_tokens``, so reuse is read from the store's ``store_tokens_reused``.
"""

from __future__ import annotations

import harness
import pytest

from kvplugin.cache.tiers.remote_keys import PREFIX
from harness import answer_text, vllm_mlx_serve_cmd

MAX_TOKENS = 4
SALT_A, SALT_B = "salt-a-5e1b77c0", "salt-b-93aa0d12"


@pytest.fixture(scope="module")
def servers(start_server, redis_server):
    remote = ("--kv-cache-remote", redis_server.url)
    return {
        "default": start_server(vllm_mlx_serve_cmd, *remote),
        "batching": start_server(vllm_mlx_serve_cmd, *remote, "--continuous-batching"),
    }


def _ask(srv, system, question, salt=None) -> tuple[dict, int]:
    """The answer and the prompt tokens the store reused for it."""
    before = srv.get("/kvplugin/stats")["store_tokens_reused"]
    extra = {} if salt is None else {"cache_salt": salt}
    r = srv.chat([system, {"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                 **extra)
    return r, srv.get("/kvplugin/stats")["store_tokens_reused"] - before


@pytest.mark.parametrize("mode", ["default", "batching"])
def test_two_salts_never_share_a_prefix_and_no_salt_reuses_as_before(servers, mode):
    srv = servers[mode]
    system = harness.briefing(50 if mode == "default" else 51)
    salt_a, salt_b = f"{SALT_A}-{mode}", f"{SALT_B}-{mode}"  # nothing stored under them yet
    a1, reused = _ask(srv, system, "Tell me about the bridge.", salt_a)
    assert reused == 0
    b1, reused = _ask(srv, system, "Tell me about the bridge.", salt_b)
    assert reused == 0  # salt a's prefix is not salt b's
    assert answer_text(b1) == answer_text(a1)  # the same answer, computed again
    a2, reused = _ask(srv, system, "When does the bakery open?", salt_a)
    prompt = a2["usage"]["prompt_tokens"]
    assert reused >= prompt // 2, (reused, a2["usage"])  # salt a reuses its own
    _, reused = _ask(srv, system, "Who repaired the bridge?")
    assert reused < prompt // 4, reused  # nor does a request without a salt see it
    n2, reused = _ask(srv, system, "Where do the buses go?")
    assert reused >= prompt // 2, (reused, n2["usage"])  # without a salt: reuse as today
    # streamed (served from another task of the request): the salt still goes with it
    assert _streamed(srv, system, "Is the mill open?", salt_b) >= prompt // 2  # b's own now
    assert _streamed(srv, system, "Is the mill open?", f"{SALT_B}-new-{mode}") == 0
    assert "could not be matched" not in srv.log_text()  # every call's request was known


def _streamed(srv, system, question, salt) -> int:
    """Prompt tokens the store reused for one streamed request."""
    before = srv.get("/kvplugin/stats")["store_tokens_reused"]
    body = {"model": srv.model, "messages": [system, {"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True, "cache_salt": salt}
    status, text = srv.request("POST", "/v1/chat/completions", body)
    assert status == 200 and "[DONE]" in str(text), (status, text)
    return srv.get("/kvplugin/stats")["store_tokens_reused"] - before


def test_a_salted_prefix_crosses_redis_for_its_salt_only(servers, redis_server):
    one, two = servers["default"], servers["batching"]
    system = harness.briefing(52)
    puts = one.get("/kvplugin/stats")["remote_puts"]
    _ask(one, system, "Describe the morning mist.", SALT_A)
    harness.wait_published(one, puts + 1)
    hits = two.get("/kvplugin/stats")["remote_hits"]
    _, reused = _ask(two, system, "Where is the market?", SALT_B)
    assert reused == 0 and two.get("/kvplugin/stats")["remote_hits"] == hits
    hit, reused = _ask(two, system, "Where is the market?", SALT_A)
    assert reused >= hit["usage"]["prompt_tokens"] // 2, (reused, hit["usage"])
    assert two.get("/kvplugin/stats")["remote_hits"] == hits + 1
    keys = [k.decode() for k in redis_server.client().keys(PREFIX + ":*")]
    assert keys and not any(SALT_A in k or SALT_B in k for k in keys)  # hashed, never in clear


def test_a_request_without_a_salt_is_refused_where_one_is_required(start_server):
    strict = start_server(vllm_mlx_serve_cmd, "--kv-cache-require-salt")
    assert "every request needs a cache_salt" in strict.log_text()
    model = harness.SERVED_MODEL_NAME
    chat = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for path, payload in (("/v1/chat/completions", chat),
                          ("/v1/completions", {"model": model, "prompt": "hello",
                                               "max_tokens": 2}),
                          ("/v1/chat/completions", {**chat, "cache_salt": 7})):
        status, out = strict.request("POST", path, payload)
        assert status == 400 and "cache_salt" in str(out), (path, status, out)
    assert answer_text(strict.chat("hello", max_tokens=2, cache_salt=SALT_A))
    assert strict.get("/kvplugin/stats")["store_entries"] >= 1  # the salted one was served
