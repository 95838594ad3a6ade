"""One ``--ssd-cache-dir`` shared by two real ``mlx_lm.server`` processes of two different
models: together they stay within ``--ssd-cache-max-gb`` (a cross-process lock, LRU over
the whole directory), both keep their most recent entries, and the temp file of a writer
killed with ``kill -9`` in the middle of a spill is gone after the next write."""

from __future__ import annotations

import time

import faults
import harness

from kvplugin.tools.models.corpus import CORPUS
from kvplugin.tools.models.tiny import build_tiny_model

BUDGET = 300_000  # bytes on disk for both servers together (~4 entries of ~70 KB)
PARAGRAPHS = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]


def _conv(i: int) -> list[dict]:
    return [{"role": "user", "content": f"#{i} " + PARAGRAPHS[i % len(PARAGRAPHS)][:200]}]


def _start(model, workdir, ssd):
    port = harness.free_port()
    return harness.ServerProcess(
        harness.mlx_lm_server_cmd(model, port, "--ssd-cache-dir", str(ssd),
                                  "--ssd-cache-max-gb", str(BUDGET / 1e9),
                                  "--prompt-cache-bytes", "80000"),
        port=port, workdir=workdir).start()


def test_two_servers_one_budget_and_no_leftovers(tiny_model, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("shared") / "kv"
    other = build_tiny_model(tmp_path_factory.mktemp("other-model"), seed=1)
    a = _start(tiny_model, tmp_path_factory.mktemp("a"), ssd)
    b = _start(other, tmp_path_factory.mktemp("b"), ssd)
    try:
        # while both servers run, with more on disk than their budget (killed at 128 KiB
        # once, the leftover was too small to show that the budget counts it)
        leftover = faults.kill_mid_spill(ssd, min_bytes=BUDGET + 1)
        assert leftover.exists() and faults.disk_usage(ssd) > BUDGET
        peak = 0
        for i in range(8):
            for srv in (a, b):
                srv.chat(_conv(i), max_tokens=8)
                time.sleep(0.3)  # mlx-lm answers before it stores (and spills)
                if i >= 1:  # once the killed writer's leftover is gone
                    peak = max(peak, faults.disk_usage(ssd))
            if i == 1:  # the first spills: each server's first entry left its hot tier
                assert not leftover.exists()  # cleaned by the next writer, not at start-up
        stats = [srv.get("/kvplugin/stats") for srv in (a, b)]
        assert all(s["store_spills"] >= 5 for s in stats), stats
        assert sum(s["cold_tier"]["evictions"] for s in stats) >= 4, stats
        assert any(s["cold_tier"]["leftovers_removed"] >= 1 for s in stats), stats
        assert peak <= BUDGET, f"{peak} bytes on disk for a budget of {BUDGET}"
    finally:
        a.stop()
        b.stop()
    assert faults.disk_usage(ssd) <= BUDGET  # also after both flushed at shut-down
    per_model = {p.parent.name for p in faults.entry_files(ssd)}
    assert len(per_model) == 2, per_model  # LRU over the directory: both keep recent entries
    assert not list(ssd.glob("*/.tmp-*")) and not list(ssd.glob("*/.claim-*"))
