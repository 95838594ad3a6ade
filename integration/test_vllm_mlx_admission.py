"""``--max-memory`` on ``vllm-mlx serve`` (default mode): a request that can never fit is
refused with 413 naming the limit and its need, instead of being prefilled, and the server
goes on serving. (Default mode runs one request at a time, so there is nothing to answer 503
for; vllm-mlx's own lock answers "busy" itself.)"""

from __future__ import annotations

import time

import pytest
from harness import answer_text, vllm_mlx_serve_cmd

from kvplugin.tools.hostproc import ServerHTTPError
from kvplugin.tools.models.corpus import CORPUS

WORDS = CORPUS.split()
LIMIT = 80 << 20  # the KV-heavy model holds ~10 MiB; a 4k-token prompt needs ~90 MiB


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

    model = build_kv_heavy_model(tmp_path_factory.mktemp("kv-heavy"))
    return start_server(vllm_mlx_serve_cmd, "--max-memory", str(LIMIT), model_dir=model)


def test_a_request_that_can_never_fit_gets_413_and_the_server_goes_on(srv):
    deadline = time.monotonic() + 60
    while (stats := srv.get("/kvplugin/stats"))["admission_base"] is None:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["max_memory"] == LIMIT
    with pytest.raises(ServerHTTPError) as err:
        srv.chat(" ".join((WORDS * 8)[:3000]), max_tokens=8)
    assert err.value.status == 413, err.value
    message = str(err.value.body)
    assert "--max-memory" in message and "KVPLUGIN_MAX_MEMORY" in message, message
    assert answer_text(srv.chat("A short question about farms?", max_tokens=8)).strip()
    after = srv.get("/kvplugin/stats")
    assert after["refused_too_large"] == 1 and after["admitted"] >= 1
    assert after["admission_reserved"] == 0
    assert after["mlx_peak_memory"] <= LIMIT
