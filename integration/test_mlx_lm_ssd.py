"""``--ssd-cache-dir``: evicted entries spill to the directory, and a new server on the same
directory serves a known prefix from it (a cold hit) on its first request."""

from __future__ import annotations

import time

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools.models.corpus import CORPUS

BUDGET = 80_000  # bytes: room for one of the entries below (1 KiB per token)
PARAGRAPHS = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]
KNOWN = [{"role": "user", "content": PARAGRAPHS[0][:200]}]
OTHER = [{"role": "user", "content": PARAGRAPHS[1][:200]}]


@pytest.fixture(scope="module")
def ssd_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ssd") / "kv"  # does not exist yet: created by the tier


def _start(tiny_model, tmp_path_factory, ssd_dir):
    port = harness.free_port()
    srv = harness.ServerProcess(
        harness.mlx_lm_server_cmd(tiny_model, port, "--ssd-cache-dir", str(ssd_dir),
                                  "--prompt-cache-bytes", str(BUDGET)),
        port=port, workdir=tmp_path_factory.mktemp("ssd-server"))
    return srv.start()


def test_evictions_spill_and_survive_a_restart(tiny_model, tmp_path_factory, ssd_dir):
    first = _start(tiny_model, tmp_path_factory, ssd_dir)
    try:
        assert f"cold tier: {ssd_dir}" in first.log_text()
        known = first.chat(KNOWN, max_tokens=8)
        first.chat(OTHER, max_tokens=8)  # evicts KNOWN's entry: it spills to the directory
        deadline = time.monotonic() + 10  # mlx-lm answers before it stores
        while (stats := first.get("/kvplugin/stats"))["store_spills"] < 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert stats["store_spills"] >= 1, stats
        assert stats["store_cold_entries"] >= 1 and stats["store_bytes"] <= BUDGET
    finally:
        assert first.stop() is not None
    files = sorted(p.name for p in ssd_dir.rglob("*.safetensors"))
    assert files, list(ssd_dir.rglob("*"))

    second = _start(tiny_model, tmp_path_factory, ssd_dir)
    try:
        stats = second.get("/kvplugin/stats")
        assert stats["store_cold_entries"] >= 1 and stats["store_entries"] == 0
        again = second.chat(KNOWN, max_tokens=8)  # the first request of the new server
        n_prompt = again["usage"]["prompt_tokens"]
        assert cached_tokens(again) == n_prompt - 1, again["usage"]
        stats = second.get("/kvplugin/stats")
        assert stats["store_cold_hits"] == 1 and stats["store_hits"] == 1, stats
        assert answer_text(again) == answer_text(known)  # fp16 round trip through the file
    finally:
        second.stop()


def test_flipped_bytes_in_an_entry_are_never_served(tiny_model, tmp_path_factory, ssd_dir):
    """Damage inside an entry file's key data, as a failing disk makes it: the next server
    answers exactly as stock does (a miss, not the damaged prefix) and counts it."""
    import json
    import struct

    files = sorted(ssd_dir.rglob("*.safetensors"))
    assert files  # left by the test above
    for path in files:
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        start, _ = json.loads(raw[8:8 + n])["l0.keys"]["data_offsets"]
        pos = 8 + n + start + 64
        path.write_bytes(raw[:pos] + bytes(b ^ 0x5A for b in raw[pos:pos + 64]) + raw[pos + 64:])
    port = harness.free_port()
    stock = harness.ServerProcess(harness.mlx_lm_server_cmd(tiny_model, port), port=port,
                                  env={"KVPLUGIN_DISABLE": "1"},
                                  workdir=tmp_path_factory.mktemp("stock")).start()
    try:
        want = answer_text(stock.chat(KNOWN, max_tokens=8))
    finally:
        stock.stop()
    third = _start(tiny_model, tmp_path_factory, ssd_dir)
    try:
        got = third.chat(KNOWN, max_tokens=8)
        assert answer_text(got) == want
        assert not cached_tokens(got)  # the damaged prefix was not reused
        stats = third.get("/kvplugin/stats")
        assert stats["cold_corrupt"] >= 1 and stats["store_cold_hits"] == 0, stats
    finally:
        third.stop()
