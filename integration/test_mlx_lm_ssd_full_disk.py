"""``--ssd-cache-dir`` on a full disk (a small tmpfs that an operator's file fills) behind a
real ``mlx_lm.server``: a spill that hits ENOSPC evicts the tier's oldest entries and
retries, so spills keep succeeding; when nothing of the tier's is left to evict, spills
fail, are counted, said once (not once per spill), and the server keeps serving."""

from __future__ import annotations

import time

import faults
import harness

from kvplugin.tools.models.corpus import CORPUS

PARAGRAPHS = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]


def _conv(i: int) -> list[dict]:
    return [{"role": "user", "content": f"#{i} " + PARAGRAPHS[i % len(PARAGRAPHS)][:200]}]


def _settle(srv, key: str, n: int) -> dict:
    """Stats once the tier's ``key`` reached ``n`` and stopped moving (mlx-lm answers
    before it stores and spills)."""
    deadline = time.monotonic() + 10
    last = None
    while True:
        stats = srv.get("/kvplugin/stats")
        now = stats["cold_tier"][key]
        if (now >= n and now == last) or time.monotonic() > deadline:
            return stats
        last = now
        time.sleep(0.3)


def test_a_full_disk_evicts_to_make_room(tiny_model, tmp_path_factory):
    mount = tmp_path_factory.mktemp("tmpfs")
    with faults.small_tmpfs(mount, "512k"):
        ssd = mount / "kv"
        port = harness.free_port()
        srv = harness.ServerProcess(
            harness.mlx_lm_server_cmd(tiny_model, port, "--ssd-cache-dir", str(ssd),
                                      "--prompt-cache-bytes", "80000"),  # every turn spills
            port=port, workdir=tmp_path_factory.mktemp("full-disk")).start()
        try:
            faults.fill_disk(mount, leave=240_000)  # room for ~3 entries of ~70 KB
            for i in range(10):
                srv.chat(_conv(i), max_tokens=8)
            stats = _settle(srv, "puts", 9)
            tier = stats["cold_tier"]
            assert tier["puts"] == stats["store_spills"] >= 9, tier  # none was lost
            assert tier["refused"] == 0, tier
            assert tier["evictions"] >= 3 and tier["write_failures"] == 0, tier  # made room
            assert 1 <= len(faults.entry_files(ssd)) <= 4, sorted(ssd.rglob("*"))
            # nothing of the tier's left to evict: spills fail, counted, said once
            for p in faults.entry_files(ssd):
                p.unlink()
            faults.fill_disk(mount, leave=0)
            for i in range(10, 15):
                srv.chat(_conv(i), max_tokens=8)
            stats = _settle(srv, "write_failures", 5)
            assert stats["cold_tier"]["write_failures"] >= 5, stats["cold_tier"]
            assert stats["cold_write_failures"] == stats["cold_tier"]["write_failures"]
            assert srv.log_text().count("cold tier write failed") == 1
            status, body = srv.request("GET", "/metrics")
            text = body.decode() if isinstance(body, bytes) else str(body)
            failures = stats["cold_write_failures"]
            assert status == 200 and f"kvplugin_cold_write_failures_total {failures:.1f}" in text
            assert f"kvplugin_cold_evictions_total {stats['cold_evictions']:.1f}" in text
            assert harness.answer_text(srv.chat(_conv(0), max_tokens=4))  # still serving
            assert not list(ssd.glob("*/.tmp-*"))
        finally:
            srv.stop()
