"""``kvplugin bench --pressure`` end to end on real servers (tiny model, short prompts): every
row measured, the pressure server demoted where ``always`` quantized everything, and it kept
at least the conversations ``always`` kept (counts are deterministic; no time is asserted:
that is the benchmark's job)."""

from __future__ import annotations

import json

import pytest

from kvplugin.tools.bench import pressure

# kvplugin's own tooling, not a host seam: tox runs it on the newest tested host version only
pytestmark = pytest.mark.tooling


def test_pressure_bench_measures_every_policy(tmp_path):
    assert pressure.main(["--tiny", "--prefix-tokens", "256", "--fp16-entries", "2",
                          "--conversations", "4", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "pressure.json").read_text())
    room, tight = res["room_to_spare"], res["under_pressure"]
    for policy in pressure.POLICIES:
        assert room[policy]["warm_ttft_s"] > 0 and tight[policy]["vmhwm_bytes"] > 0
    assert room["pressure"]["entries_quantized"] == 0 and room["pressure"]["hits_demoted"] == 0
    assert room["pressure"]["hits_full"] >= 3  # every warm turn a full-precision move
    assert room["always"]["entries_quantized"] > 0
    assert tight["pressure"]["demotions"] > 0 and tight["always"]["demotions"] == 0
    assert tight["pressure"]["kept"] >= tight["always"]["kept"] >= 1, tight
    assert len(tight["pressure_memory"]) > 0
    assert "warm TTFT" in (tmp_path / "pressure.md").read_text()
