"""``kvplugin bench --server --remote`` end to end on real servers and a real redis-server
(tiny model, one short prefix): every row measured, replica B reused what replica A
published, answered as stock at fp16, and 8-bit entries moved fewer bytes than fp16 (bytes
are deterministic; no time is asserted: that is the benchmark's job)."""

from __future__ import annotations

import json

import pytest

from kvplugin.tools.bench import remote

# kvplugin's own tooling, not a host seam: tox runs it on the newest tested host version only
pytestmark = pytest.mark.tooling


def test_remote_bench_measures_a_warm_hit_on_the_other_replica(tmp_path):
    assert remote.main(["--tiny", "--sizes", "400", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "remote.json").read_text())
    by = {r["entries"]: r for r in rows}
    assert set(by) == {"fp16", "8-bit"}
    for r in rows:
        assert r["prompt_tokens"] >= 300 and r["cached_tokens"] >= 0.9 * r["prompt_tokens"], r
        assert r["cold_ttft_s"] > 0 and r["warm_remote_ttft_s"] > 0 and r["miss_ttft_kvplugin_s"] > 0
        assert r["miss_remote_wait_s"] >= 0
    assert by["fp16"]["same_answer"] is True
    assert 0 < by["8-bit"]["bytes_per_hit"] < 0.7 * by["fp16"]["bytes_per_hit"]
    assert "cold TTFT (stock)" in (tmp_path / "remote.md").read_text()
