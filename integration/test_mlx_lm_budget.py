"""The host's ``--prompt-cache-bytes`` holds after every request on both paths (stock enforces
it on the batched path only), and ``--hot-cache-only`` writes nothing anywhere."""

from __future__ import annotations

import os
import time
from pathlib import Path

import harness
import pytest
from harness import answer_text

from kvplugin.tools.models.corpus import CORPUS

BUDGET = 100_000  # bytes: ~97 tokens of the tiny model (1 KiB per token)
WORDS = CORPUS.split()


def _prompt(i: int, n_words: int) -> str:
    start = (i * 37) % (len(WORDS) - n_words)
    return f"Request {i}: " + " ".join(WORDS[start:start + n_words])


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(harness.mlx_lm_server_cmd, "--hot-cache-only",
                        "--prompt-cache-bytes", str(BUDGET), "--prompt-cache-size", "50")


def _files(*roots: Path, skip: tuple[Path, ...] = ()) -> dict[str, int]:
    out = {}
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                if p in skip:
                    continue
                try:
                    out[str(p)] = p.stat().st_size
                except FileNotFoundError:
                    pass
    return out


def _stats_after_insert(srv, before: dict) -> dict:
    """Stats once the last request's entry is handled (mlx-lm answers before it stores)."""
    deadline = time.monotonic() + 10
    while True:
        stats = srv.get("/kvplugin/stats")
        done = stats["store_stored"] + stats["store_rejected"]
        if done > before["store_stored"] + before["store_rejected"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


@pytest.mark.parametrize("seed", [11, None], ids=["sequential", "batched"])
def test_byte_budget_holds_after_every_request(srv, seed):
    before = srv.get("/kvplugin/stats")
    assert before["max_bytes"] == BUDGET and before["hot_cache_only"] is True
    stats = before
    for i, n_words in enumerate([10, 30, 20, 40, 15, 35, 25, 38, 12, 30]):
        r = srv.chat(_prompt(i, n_words), max_tokens=8, seed=seed)
        assert answer_text(r).strip()
        stats = _stats_after_insert(srv, stats)
        assert stats["store_bytes"] <= BUDGET, (i, stats)
        assert sum(e["nbytes"] for e in stats["entries"]) == stats["store_bytes"]
        assert stats["store_entries"] >= 1  # the budget is used, not just emptied
    after = srv.get("/kvplugin/stats")
    stored = after["store_stored"] - before["store_stored"]
    assert stored >= 10
    # more was stored than fits: older entries were evicted and, hot-only, discarded
    assert after["store_evictions"] > before["store_evictions"]
    assert after["store_discarded"] > before["store_discarded"]
    assert after["store_spills"] == 0


def test_entry_larger_than_the_budget_is_not_kept(srv):
    before = srv.get("/kvplugin/stats")
    srv.chat(" ".join(WORDS[:150]), max_tokens=4, seed=2)  # ~200 tokens > BUDGET
    stats = _stats_after_insert(srv, before)
    assert stats["store_rejected"] > before["store_rejected"]
    assert stats["store_bytes"] <= BUDGET


def test_hot_cache_only_writes_no_file(srv):
    roots = (srv.workdir, srv.home)  # the server's cwd and HOME (HF_HOME lies under it)
    skip = (srv.log_path,)
    before = _files(*roots, skip=skip)
    for i in range(8):  # evictions on both paths, with the tiny budget
        srv.chat(_prompt(100 + i, 40), max_tokens=6, seed=(i if i % 2 else None))
    stats = srv.get("/kvplugin/stats")
    assert stats["store_evictions"] > 0 and stats["store_cold_entries"] is None  # was -1: "not configured" is null
    after = _files(*roots, skip=skip)
    assert after == before, sorted(set(after) ^ set(before))
