"""``--max-memory``: a real ``mlx_lm.server`` refuses what it cannot hold instead of running out
of memory, and keeps serving everyone else.

The model is the KV-heavy llama (16 KiB of KV per token), so a request's memory is almost all
KV and a limit of a few tens of MiB separates "fits", "fits only alone" and "never fits".
"""

from __future__ import annotations

import time

import harness
import pytest
from harness import answer_text

from kvplugin.tools.hostproc import ServerHTTPError
from kvplugin.tools.models.corpus import CORPUS

WORDS = CORPUS.split()
LIMIT = 80 << 20  # the model holds ~10 MiB; one 1.1k-token request needs ~41 MiB


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

    model = build_kv_heavy_model(tmp_path_factory.mktemp("kv-heavy"))
    return start_server(harness.mlx_lm_server_cmd, "--max-memory", str(LIMIT),
                        "--hot-cache-only", model_dir=model)


def _prompt(tag: str, n_words: int) -> str:
    text = " ".join((WORDS * 8)[:n_words])
    return f"{tag}: {text}"


def test_the_limit_is_in_force(srv):
    deadline = time.monotonic() + 60  # the model loads (and is probed) after /health answers
    while (stats := srv.get("/kvplugin/stats"))["admission_base"] is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert stats["max_memory"] == LIMIT
    assert stats["admission_base"] and stats["admission_base"] < LIMIT  # the model, probed


def test_a_buffer_cache_past_a_quarter_of_the_limit_is_handed_back_after_a_request(srv):
    """No eviction needed: a request's transients left in MLX's buffer cache beyond a quarter
    of --max-memory are released when it ends (the limit here is 80 MiB: 20 MiB). It runs
    before the module's other tests, while nothing is stored, so no eviction releases."""
    before = srv.get("/kvplugin/stats")
    # ~1.1k tokens and a long decode: its growth leaves tens of MiB in MLX's buffer cache
    srv.chat(_prompt("bloat", 700), max_tokens=300)
    deadline = time.monotonic() + 30
    while (after := srv.get("/kvplugin/stats"))["memory_releases"] == before["memory_releases"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after["store_evictions"] == before["store_evictions"]  # not an eviction's release
    assert after["mlx_cache_memory"] <= LIMIT // 4


def test_a_request_that_can_never_fit_gets_413_naming_limit_and_need(srv):
    with pytest.raises(ServerHTTPError) as err:
        srv.chat(_prompt("huge", 3000), max_tokens=8)  # ~4k tokens: ~70 MiB of KV alone, beyond the limit with the model
    assert err.value.status == 413, err.value
    message = str(err.value.body)
    assert "--max-memory" in message and "KVPLUGIN_MAX_MEMORY" in message
    assert "MiB" in message and "needs an estimated" in message
    stats = srv.get("/kvplugin/stats")
    assert stats["refused_too_large"] >= 1
    # and the server goes on serving
    assert answer_text(srv.chat(_prompt("small", 50), max_tokens=4)).strip()


def test_two_large_concurrent_requests_give_one_503_and_the_retry_is_served(srv):
    harness.assert_busy_then_served(srv, _prompt("first", 700), _prompt("second", 700),
                                    limit=LIMIT)

