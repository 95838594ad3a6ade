"""Codec work two layers at a time on the CPU (kvplugin.cache.lanes)."""

from __future__ import annotations

import mlx.core as mx

from kvplugin.cache import lanes


def test_two_lanes_on_a_multicore_cpu_one_on_a_gpu(monkeypatch):
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(lanes.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert lanes.lane_count() == 2
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: 1)
    assert lanes.lane_count() == 1
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(lanes.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert lanes.lane_count() == 1  # one kernel fills a GPU: the default stream


def test_results_come_in_order_evaluated_and_at_most_two_in_flight(monkeypatch):
    monkeypatch.setattr(lanes, "lane_count", lambda: 2)
    made: list[int] = []
    seen: list[int] = []

    def work(i: int) -> mx.array:
        made.append(i)
        return mx.full((4,), i) * 2

    for i, out in enumerate(lanes.in_lanes(iter(range(5)), work, lambda r: [r])):
        assert len(made) - len(seen) <= 2 and len(made) <= i + 2  # pairs, not the whole list
        seen.append(int(out[0].item()))
    assert seen == [0, 2, 4, 6, 8] and made == [0, 1, 2, 3, 4]
