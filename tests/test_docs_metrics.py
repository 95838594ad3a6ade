"""docs/metrics.md lists exactly what kvplugin reports (like test_docs for the settings)."""

from __future__ import annotations

import re
from pathlib import Path

from kvplugin import metrics
from kvplugin.cache.service.service import KVService
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings

DOC = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
HOST_ONLY = {"mode"}  # vllm-mlx adds its mode to the report


def first_column(section: str) -> set[str]:
    body = DOC.split(section, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", body, flags=re.M))


def test_every_stats_field_is_documented_and_nothing_else():
    pm = create_plugin_manager(load_entry_points=False)
    report = KVService(resolve_settings(), host="mlx-lm", hook=pm.hook).report(host_version="x")
    assert first_column("## `/kvplugin/stats` fields") == set(report) | HOST_ONLY


def test_every_series_is_documented_and_nothing_else():
    names = {f"kvplugin_{n}_total" for n, _, _ in metrics.COUNTERS}
    names |= {f"kvplugin_{n}" for n, _, _ in metrics.GAUGES}
    assert first_column("## Prometheus series") == names
