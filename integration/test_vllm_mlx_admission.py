"""``--max-memory`` on ``vllm-mlx serve``: a request that can never fit is refused with 413
naming the limit and its need, instead of being prefilled, and the server goes on serving; in
``--continuous-batching`` mode two large concurrent requests give one 503 with
``Retry-After``, and the retry is served. (Default mode runs one request at a time, so there
is nothing to answer 503 for: vllm-mlx's own lock answers "busy" itself.)"""

from __future__ import annotations

import time

import harness
import pytest
from harness import answer_text, vllm_mlx_serve_cmd

from kvplugin.tools.hostproc import ServerHTTPError
from kvplugin.tools.models.corpus import CORPUS

WORDS = CORPUS.split()
LIMIT = 80 << 20  # the KV-heavy model holds ~10 MiB; a 4k-token prompt needs ~90 MiB


@pytest.fixture(scope="module")
def kv_heavy(tmp_path_factory):
    from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

    return build_kv_heavy_model(tmp_path_factory.mktemp("kv-heavy"))


@pytest.fixture(scope="module")
def default_srv(start_server, kv_heavy):
    return start_server(vllm_mlx_serve_cmd, "--max-memory", str(LIMIT), model_dir=kv_heavy)


@pytest.fixture(scope="module")
def batching_srv(start_server, kv_heavy):
    return start_server(vllm_mlx_serve_cmd, "--max-memory", str(LIMIT), "--continuous-batching",
                        model_dir=kv_heavy)


def _probed(srv) -> dict:
    deadline = time.monotonic() + 60
    while (stats := srv.get("/kvplugin/stats"))["admission_base"] is None:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


@pytest.mark.parametrize("mode", ["default_srv", "batching_srv"])
def test_a_request_that_can_never_fit_gets_413_and_the_server_goes_on(request, mode):
    srv = request.getfixturevalue(mode)
    stats = _probed(srv)
    assert stats["max_memory"] == LIMIT
    with pytest.raises(ServerHTTPError) as err:
        srv.chat(" ".join((WORDS * 8)[:3000]), max_tokens=8)
    assert err.value.status == 413, err.value
    message = str(err.value.body)
    assert "--max-memory" in message and "KVPLUGIN_MAX_MEMORY" in message, message
    assert answer_text(srv.chat("A short question about farms?", max_tokens=8)).strip()
    after = harness.wait_released(srv)
    assert after["refused_too_large"] == stats["refused_too_large"] + 1
    assert after["admitted"] >= 1
    assert after["mlx_peak_memory"] <= LIMIT


def test_batching_two_large_concurrent_requests_give_one_503_and_the_retry_is_served(
        batching_srv):
    _probed(batching_srv)
    prompt = " ".join((WORDS * 8)[:700])  # ~1.1k tokens: ~41 MiB each with 300 new tokens
    harness.assert_busy_then_served(batching_srv, "first: " + prompt, "second: " + prompt,
                                    limit=LIMIT)
