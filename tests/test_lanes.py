"""Codec work two layers at a time on the CPU (kvplugin.cache.codec.lanes)."""

from __future__ import annotations

import mlx.core as mx

from kvplugin.cache.codec import lanes


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


def test_open_lanes_starts_this_thread_s_streams_before_any_codec_work(monkeypatch):
    """Made at model load in the serving thread (KVService.learn_model with serving_thread,
    as mlx-lm's adapter calls it), the lanes' streams exist before the first hit, and
    in_lanes then uses those very streams; a host loading elsewhere makes none."""
    import threading

    from kvplugin.cache.service.service import KVService
    from kvplugin.plugins import create_plugin_manager
    from kvplugin.settings import resolve_settings

    monkeypatch.setattr(lanes, "lane_count", lambda: 2)
    service = KVService(resolve_settings(), host="test",
                        hook=create_plugin_manager(load_entry_points=False).hook)
    seen = {}

    def serving_thread():
        seen["before"] = getattr(lanes._local, "streams", None)
        service.learn_model(object(), [])  # not the serving thread: nothing made
        seen["not serving"] = getattr(lanes._local, "streams", None)
        service.learn_model(object(), [], serving_thread=True)  # no --max-memory: only lanes
        seen["opened"] = list(lanes._local.streams)
        list(lanes.in_lanes(iter(range(2)), lambda i: mx.full((2,), i), lambda r: [r]))
        seen["used"] = list(lanes._local.streams)

    t = threading.Thread(target=serving_thread)
    t.start()
    t.join()
    assert seen["before"] is None and seen["not serving"] is None
    assert len(seen["opened"]) == 2 and seen["used"] == seen["opened"]
