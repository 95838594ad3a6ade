"""``kvplugin bench --bound`` runs end to end on the real KV-heavy model and reports, for
every case and cache, the figures docs/benchmarks.md quotes (tiny sizes: a smoke run)."""

from __future__ import annotations

import json

import pytest

from kvplugin import cli

# kvplugin's own tooling, not a host seam: tox runs it on the newest tested host version only
pytestmark = pytest.mark.tooling


def test_bound_bench_reports_every_cache(tmp_path):
    out = tmp_path / "bound"
    assert cli.main(["bench", "--bound", "--contexts", "300", "--bounds", "256",
                     "--decode", "4", "--rounds", "2", "--out", str(out)]) == 0
    data = json.loads((out / "bound.json").read_text())
    assert data["meta"]["produced_by"].startswith("kvplugin bench --bound")
    (case,) = data["results"]
    assert (case["context"], case["bound"]) == (300, 256)
    caches = case["caches"]
    assert set(caches) == {"stock growth", "stock rotating", "kvplugin"}
    per_token = 16 * 1024
    assert caches["stock growth"]["live_kv_bytes"] == 300 * per_token
    assert caches["kvplugin"]["live_kv_bytes"] == 256 * per_token  # the bound keeps 256
    # a wrapped bound holds exactly the bound; stock growth its 256-slot steps
    assert caches["kvplugin"]["held_after_bytes"] == 256 * per_token
    assert caches["stock growth"]["held_bytes"] == 512 * per_token
    for r in caches.values():
        assert len(r["rounds"]) == 2 and r["tok_s"] > 0
    assert "| 300 | 256 | kvplugin |" in (out / "bound.md").read_text()


@pytest.mark.real_model
def test_batched_bound_bench_reports_every_way_to_serve(tmp_path):
    out = tmp_path / "bound"
    assert cli.main(["bench", "--bound", "--batched", "--bounds", "64", "--decode", "3",
                     "--rounds", "1", "--out", str(out)]) == 0
    data = json.loads((out / "bound_batched.json").read_text())
    assert data["produced_by"].startswith("kvplugin bench --bound --batched")
    assert data["bound"] == 64 and data["rows"] == 2 and data["prompt_tokens"] > 64
    assert set(data["tokens_per_s"]) == {"stock batch", "kvplugin batch", "one at a time"}
    assert all(t["median"] > 0 for t in data["tokens_per_s"].values())
    assert "| kvplugin batch |" in (out / "bound_batched.md").read_text()
