"""``GET /metrics`` on a real mlx_lm.server: kvplugin's series in Prometheus text format,
parsed with prometheus-client's own parser, moving with traffic (mlx-lm has no /metrics)."""

from __future__ import annotations

import urllib.request

import harness
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(harness.mlx_lm_server_cmd)


def scrape(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_move_with_traffic_and_match_stats(srv):
    before = scrape(srv)
    assert before["kvplugin_hits_total"] == 0 and "kvplugin_cold_entries" not in before
    messages = [{"role": "user", "content": "Tell me about the river and the hills."}]
    first = srv.chat(messages, max_tokens=6)
    messages += [{"role": "assistant", "content": harness.answer_text(first)},
                 {"role": "user", "content": "And then?"}]
    srv.chat(messages, max_tokens=6)
    after, stats = scrape(srv), srv.get("/kvplugin/stats")
    assert after["kvplugin_hits_total"] == stats["store_hits"] >= 1
    assert after["kvplugin_entries_stored_total"] == stats["entries_stored"] >= 2
    assert after["kvplugin_tokens_reused_total"] == stats["store_tokens_reused"] > 0
    assert after["kvplugin_bytes"] == stats["store_bytes"] > 0
    assert not [n for n in after if not n.startswith("kvplugin_")]  # nothing of the host's
