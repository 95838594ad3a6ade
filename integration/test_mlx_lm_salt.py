"""A request's ``cache_salt`` isolates its prefixes on a real ``mlx_lm.server``, in every tier.

Same long system prompt: salt "a" computes it, salt "b" reuses nothing (``cached_tokens`` 0),
salt "a" again reuses it, and requests without a salt reuse each other's as before; on both of
mlx-lm's paths. Through a real redis-server, replica 2 misses salt "a"'s published prefix with
salt "b" and hits it with salt "a". On disk, the two salts' entries live under different names,
neither salt in clear. ``--kv-cache-require-salt``: a request without one is answered 400,
naming the field.
"""

from __future__ import annotations

import time

import harness
import pytest

from harness import answer_text, cached_tokens

MAX_TOKENS = 4
SALT_A, SALT_B = "salt-a-7f3c9e21", "salt-b-0d84aa56"


@pytest.fixture(scope="module")
def replicas(start_server, redis_server):
    """Replica 1 takes any request; replica 2 requires a salt. Both share one Redis."""
    remote = ("--kv-cache-remote", redis_server.url)
    return (start_server(harness.mlx_lm_server_cmd, *remote),
            start_server(harness.mlx_lm_server_cmd, *remote, "--kv-cache-require-salt"))


def _ask(srv, system, question, salt=None, seed=None):
    extra = {} if salt is None else {"cache_salt": salt}
    return srv.chat([system, {"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                    seed=seed, **extra)


@pytest.mark.parametrize("seed", [None, 1], ids=["batched", "sequential"])
def test_two_salts_never_share_a_prefix_and_no_salt_reuses_as_before(replicas, seed):
    srv, _ = replicas
    system = harness.briefing(40 if seed is None else 41)
    salt_a, salt_b = f"{SALT_A}-{seed}", f"{SALT_B}-{seed}"  # nothing stored under them yet
    a1 = _ask(srv, system, "Tell me about the bridge.", salt_a, seed)
    assert cached_tokens(a1) == 0
    b1 = _ask(srv, system, "Tell me about the bridge.", salt_b, seed)
    assert cached_tokens(b1) == 0, b1["usage"]  # salt a's prefix is not salt b's
    assert answer_text(b1) == answer_text(a1)  # the same answer, computed again
    a2 = _ask(srv, system, "When does the bakery open?", salt_a, seed)
    prompt = a2["usage"]["prompt_tokens"]
    assert cached_tokens(a2) >= prompt // 2, a2["usage"]  # salt a reuses its own
    n1 = _ask(srv, system, "Who repaired the bridge?", None, seed)
    # nor does a request without a salt see it (at most the chat template's first tokens,
    # from the other parametrization's saltless requests)
    assert cached_tokens(n1) < prompt // 4, n1["usage"]
    n2 = _ask(srv, system, "Where do the buses go?", None, seed)
    assert cached_tokens(n2) >= prompt // 2, n2["usage"]  # without a salt: reuse as today
    assert "could not be matched" not in srv.log_text()  # every call's request was known


def test_a_salted_prefix_crosses_redis_for_its_salt_only(replicas, redis_server):
    one, two = replicas
    harness.check_salt_crosses_redis(one, two, redis_server, _ask, harness.briefing(42),
                                     SALT_A, SALT_B)


def test_a_request_without_a_salt_is_refused_where_one_is_required(replicas):
    _, strict = replicas
    assert "every request needs a cache_salt" in strict.log_text()
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for path, payload in (("/v1/chat/completions", body),
                          ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
                          ("/v1/chat/completions", {**body, "cache_salt": ""})):
        status, out = strict.request("POST", path, payload)
        assert status == 400 and "cache_salt" in str(out), (path, status, out)
    assert answer_text(strict.chat("hello", max_tokens=2, cache_salt=SALT_A))


def test_ssd_entries_of_two_salts_live_under_different_names(start_server, tmp_path):
    ssd = tmp_path / "kv"
    srv = start_server(harness.mlx_lm_server_cmd, "--ssd-cache-dir", str(ssd),
                       "--prompt-cache-size", "1")  # every entry but the newest spills
    system = harness.briefing(43)
    for i, salt in enumerate((SALT_A, SALT_B, None, SALT_A)):
        _ask(srv, system, f"Question {i}: who lives here?", salt, seed=1)
    deadline = time.monotonic() + 10
    while srv.get("/kvplugin/stats")["store_spills"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    dirs = {p.parent.name for p in ssd.rglob("*.safetensors")}
    assert len(dirs) == 3, sorted(dirs)  # salt a, salt b, no salt
    for path in ssd.rglob("*"):
        assert SALT_A not in str(path) and SALT_B not in str(path)
        if path.is_file():
            data = path.read_bytes()
            assert SALT_A.encode() not in data and SALT_B.encode() not in data
