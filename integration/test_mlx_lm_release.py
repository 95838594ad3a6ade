"""Memory kvplugin frees goes back to the system: after a real ``mlx_lm.server`` evicts a
stored entry (the byte budget makes room for the next one), MLX's buffer cache is emptied, so
MLX's memory and the process RSS fall by at least 80% of the evicted entry's bytes.

Without the release, MLX keeps the evicted entry's buffers in its buffer cache for reuse and
neither figure moves (the vllm-mlx report: a 15 GB cache cleared, the footprint fell 32 KB).
The model is the KV-heavy llama (16 KiB of KV per token), so an entry is tens of MiB and
stands far above the noise of the Python heap.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import harness
import pytest
from harness import answer_text

from kvplugin.tools.models.corpus import CORPUS

WORDS = CORPUS.split()
BUDGET = 24 << 20  # bytes: the first entry (~19 MB) fits; it and the second (~9 MB) do not


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

    model = build_kv_heavy_model(tmp_path_factory.mktemp("kv-heavy"))
    return start_server(harness.mlx_lm_server_cmd, "--hot-cache-only",
                        "--prompt-cache-bytes", str(BUDGET), model_dir=model)


def _rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def _settled(srv, key: str, above: int) -> dict:
    """Stats once ``key`` exceeds ``above`` (mlx-lm answers before it stores the entry)."""
    deadline = time.monotonic() + 30
    while True:
        stats = srv.get("/kvplugin/stats")
        if stats[key] > above or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _prompt(start: int, n_words: int) -> str:
    return " ".join(WORDS[start:start + n_words])


def test_evicting_an_entry_hands_its_memory_back(srv):
    first = srv.chat(_prompt(0, 700), max_tokens=2, seed=1)
    assert answer_text(first) is not None
    before = _settled(srv, "store_stored", 0)
    assert before["store_entries"] == 1, before
    evicted = before["entries"][0]["nbytes"]
    assert evicted > 16 << 20, before["entries"]  # the entry dwarfs the heap's noise
    rss_before = _rss(srv.pid)
    mlx_before = before["mlx_active_memory"] + before["mlx_cache_memory"]

    # a second conversation whose entry does not fit beside the first: the first is evicted
    srv.chat("Second: " + _prompt(700, 342), max_tokens=2, seed=1)
    after = _settled(srv, "store_evictions", before["store_evictions"])
    # the release follows the eviction in the storing thread, once the store's lock is let
    # go, so a stats read can fall between the two (CI caught one)
    after = _settled(srv, "memory_releases", before["memory_releases"])
    assert after["store_evictions"] == before["store_evictions"] + 1, after
    assert after["store_entries"] == 1
    kept = after["entries"][0]["nbytes"]
    assert kept < evicted

    assert after["memory_releases"] > before["memory_releases"]
    assert after["bytes_released"] > before["bytes_released"]
    mlx_after = after["mlx_active_memory"] + after["mlx_cache_memory"]
    # what the process holds fell by the evicted entry, less what the new entry holds
    assert mlx_before - mlx_after >= 0.8 * evicted - kept, (mlx_before, mlx_after, evicted, kept)
    rss_after = _rss(srv.pid)
    assert rss_before - rss_after >= 0.8 * evicted - kept, (rss_before, rss_after, evicted, kept)
