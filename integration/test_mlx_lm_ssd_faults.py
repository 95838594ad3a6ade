"""SSD tier faults behind a real ``mlx_lm.server``: entries that do not fit the model and a
read-only tier.

One spilling server leaves three conversations' entries in a directory; two of them are then
narrowed to head_dim 32 (the tiny model's is 64) with a valid digest, and the directory is
bind-mounted read-only. A second server on it must: serve the valid entry (a read-only tier
still serves reads), refuse the narrowed ones on both mlx-lm paths (batched: the default;
sequential: a request with ``seed``) and answer exactly as stock does, count them, and keep
serving (the generation thread survives).
"""

from __future__ import annotations

import time

import faults
import pytest
import harness
from harness import answer_text, cached_tokens

from kvplugin.tools.models.corpus import CORPUS

BUDGET = 80_000  # bytes: room for one of the entries below (1 KiB per token)
PARAGRAPHS = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]
CONVS = [[{"role": "user", "content": PARAGRAPHS[i][:200]}] for i in range(5)]


def _start(tiny_model, workdir, *extra, env=None):
    port = harness.free_port()
    return harness.ServerProcess(harness.mlx_lm_server_cmd(tiny_model, port, *extra),
                                 port=port, env=env, workdir=workdir).start()


def _wait_spills(srv, n: int) -> dict:
    deadline = time.monotonic() + 10  # mlx-lm answers before it stores
    while (stats := srv.get("/kvplugin/stats"))["store_spills"] < n:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return stats


def test_invalid_entries_on_a_read_only_tier(tiny_model, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("faults") / "kv"
    ssd.mkdir(mode=0o750)  # the operator's directory and mode
    ssd.chmod(0o750)
    spiller = _start(tiny_model, tmp_path_factory.mktemp("spiller"), "--ssd-cache-dir",
                     str(ssd), "--prompt-cache-bytes", str(BUDGET))
    owner: dict = {}
    try:
        for i, conv in enumerate(CONVS):
            before = set(faults.entry_files(ssd))
            spiller.chat(conv, max_tokens=8)
            if i:  # conversation i-1 was evicted by this one: its file is the new one
                assert _wait_spills(spiller, i)["store_spills"] >= i
                for p in set(faults.entry_files(ssd)) - before:
                    owner[p] = i - 1
    finally:
        spiller.stop()
    assert sorted(set(owner.values())) == [0, 1, 2, 3], owner
    assert ssd.stat().st_mode & 0o777 == 0o750  # left as the operator set it
    mdirs = {p.parent for p in owner}
    assert len(mdirs) == 1 and all(d.stat().st_mode & 0o777 == 0o700 for d in mdirs)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in faults.entry_files(ssd))
    narrowed = [p for p, i in owner.items() if i in (0, 1)]  # conversations 0 and 1
    assert faults.narrow_entries(narrowed, 32) == len(narrowed) >= 2
    # conversation 3's entries move outside the directory and entry-named symlinks take
    # their place: never followed, never served, counted
    linked = [p for p, i in owner.items() if i == 3]
    for p in linked:
        outside = tmp_path_factory.mktemp("outside") / p.name
        p.rename(outside)
        p.symlink_to(outside)

    stock = _start(tiny_model, tmp_path_factory.mktemp("stock"), env={"KVPLUGIN_DISABLE": "1"})
    try:
        want_batched = answer_text(stock.chat(CONVS[0], max_tokens=8))
        want_seeded = answer_text(stock.chat(CONVS[1], max_tokens=8, seed=7))
        want_valid = answer_text(stock.chat(CONVS[2], max_tokens=8))
        want_linked = answer_text(stock.chat(CONVS[3], max_tokens=8))
    finally:
        stock.stop()

    with faults.read_only(ssd):
        srv = _start(tiny_model, tmp_path_factory.mktemp("reader"), "--ssd-cache-dir",
                     str(ssd), "--prompt-cache-bytes", str(BUDGET))
        try:
            stats = srv.get("/kvplugin/stats")
            n_files = len(faults.entry_files(ssd))
            assert stats["store_cold_entries"] == n_files - len(linked), stats  # no symlink
            assert stats["cold_symlinks"] == len(linked), stats
            via_link = srv.chat(CONVS[3], max_tokens=8)
            assert answer_text(via_link) == want_linked
            # at most the chat template's first tokens, shared with another entry
            assert (cached_tokens(via_link) or 0) < via_link["usage"]["prompt_tokens"] // 4
            assert all(p.is_symlink() for p in linked)
            # a read-only tier still serves reads
            valid = srv.chat(CONVS[2], max_tokens=8)
            assert cached_tokens(valid) == valid["usage"]["prompt_tokens"] - 1, valid["usage"]
            assert answer_text(valid) == want_valid
            stats = srv.get("/kvplugin/stats")
            assert stats["entries_invalid"] == 0, stats
            hits = stats["store_hits"]
            # the batched path (default): refused, answered as stock, counted
            got = srv.chat(CONVS[0], max_tokens=8)
            assert answer_text(got) == want_batched and not cached_tokens(got)
            stats = srv.get("/kvplugin/stats")
            assert stats["entries_invalid"] == 1, stats
            assert stats["store_hits"] == hits, stats  # a refused entry is a miss
            # the sequential path (a seed): the same
            got = srv.chat(CONVS[1], max_tokens=8, seed=7)
            assert answer_text(got) == want_seeded
            # at most the chat template's few first tokens, shared with a hot entry
            assert (cached_tokens(got) or 0) < got["usage"]["prompt_tokens"] // 4, got["usage"]
            stats = srv.get("/kvplugin/stats")
            assert stats["entries_invalid"] == 2, stats
            # still serving, on both paths, and the refused files are still on disk (read-only)
            assert answer_text(srv.chat(CONVS[0], max_tokens=8)) == want_batched
            assert answer_text(srv.chat(CONVS[4], max_tokens=4, seed=1))
            assert all(p.exists() for p in narrowed)
            log = srv.log_text()
            assert log.count("does not fit the model") == 1  # said once, counted twice
            assert "generation thread died" not in log
        finally:
            srv.stop()


# how mlx-lm fails one request: an error status, or (non-streaming, after its context was
# sent) a connection closed without a response
FAILED = (harness.ServerHTTPError, OSError)


def test_an_error_while_the_host_uses_an_entry_costs_one_request(tiny_model, tmp_path_factory):
    """An entry that breaks only inside mlx-lm's loop (a plugin hands it over after every
    check): the request fails, the generation thread does not (batched and sequential)."""
    env, trigger = faults.breaking_plugin(tmp_path_factory.mktemp("plugin"))
    srv = _start(tiny_model, tmp_path_factory.mktemp("breaker"), env=env)
    try:
        first = answer_text(srv.chat(CONVS[0], max_tokens=8))  # a miss: nothing to break
        trigger.touch()
        with pytest.raises(FAILED):  # batched (the default): the next fetch is broken
            srv.chat(CONVS[0], max_tokens=8)
        assert not trigger.exists()
        assert answer_text(srv.chat(CONVS[0], max_tokens=8)) == first  # still serving
        trigger.touch()
        with pytest.raises(FAILED):  # sequential (a seed): the same
            srv.chat(CONVS[0], max_tokens=8, seed=3)
        assert not trigger.exists()
        assert answer_text(srv.chat(CONVS[1], max_tokens=8))
        assert answer_text(srv.chat(CONVS[1], max_tokens=8, seed=3))
        assert srv.request("GET", "/health")[0] == 200
        log = srv.log_text()
        assert "generation loop failed" in log and "the server goes on" in log
    finally:
        srv.stop()
