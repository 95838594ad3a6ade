"""``--kv-cache-quantization-policy pressure`` on a real mlx_lm.server: entries stay at full
precision while the budget holds them and are demoted (quantized in place) when it does not,
before any is evicted. Five conversations whose fp16 entries overflow the budget but fit it
quantized: the server demotes (``/kvplugin/stats``, ``/metrics``), a hit on a full-precision
entry answers as stock does, and it keeps at least the conversations ``always`` keeps."""

from __future__ import annotations

import time
import urllib.request

import harness
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplugin.tools.models.corpus import CORPUS

BUDGET = 200_000  # bytes: 3 of these conversations' fp16 entries (1 KiB per token), 5 at 8 bits
QUANT = ("--kv-cache-quantization-bits", "8", "--kv-cache-min-quantize-tokens", "0",
         "--kv-cache-sink-tokens", "8")  # the chat template's first tokens stay exact
COMMON = ("--prompt-cache-bytes", str(BUDGET), "--prompt-cache-size", "50")
WORDS = CORPUS.split()
CONVERSATIONS = 5
FP16_HOLDS = 3  # conversations the budget holds at full precision (~65 KB each)
KEPT = 40  # prompt tokens a later turn reuses when its conversation's entry was kept


def first_turn(i: int) -> list[dict]:
    start = (i * 53) % (len(WORDS) - 50)
    return [{"role": "user", "content": f"Story {i}: " + " ".join(WORDS[start:start + 25])}]


def second_turn(i: int, answer: str) -> list[dict]:
    return [*first_turn(i), {"role": "assistant", "content": answer},
            {"role": "user", "content": "Go on."}]


def stored(srv, before: dict, timeout: float = 10.0) -> dict:
    """The stats once the last request's entry is stored and the worker has gone quiet
    (mlx-lm answers before it stores; the worker demotes after)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        stats = srv.get("/kvplugin/stats")
        moved = stats["store_stored"] > before["store_stored"]
        if moved and last is not None and all(
                last[k] == stats[k] for k in ("store_stored", "demotions", "store_bytes")):
            return stats
        last = stats
        time.sleep(0.1)
    return srv.get("/kvplugin/stats")


def run(srv, kv: bool) -> dict:
    """Both turns of every conversation (second turns newest first); per second turn its
    answer, the prompt tokens reused and whether a full-precision entry served it."""
    answers = {}
    stats = srv.get("/kvplugin/stats") if kv else None
    for i in range(CONVERSATIONS):
        answers[i] = harness.answer_text(srv.chat(first_turn(i), max_tokens=8))
        stats = stored(srv, stats) if kv else None
    out = {}
    for i in reversed(range(CONVERSATIONS)):
        text = harness.answer_text(srv.chat(second_turn(i, answers[i]), max_tokens=8))
        if kv:
            after = stored(srv, stats)
            out[i] = (text, after["store_tokens_reused"] - stats["store_tokens_reused"],
                      after["hits_full"] - stats["hits_full"])
            stats = after
        else:
            out[i] = (text, None, None)
    return out


@pytest.fixture(scope="module")
def runs(start_server):
    stock = start_server(harness.mlx_lm_server_cmd, *COMMON, env={"KVPLUGIN_DISABLE": "1"})
    always = start_server(harness.mlx_lm_server_cmd, *COMMON, "--hot-cache-only", *QUANT)
    pressure = start_server(harness.mlx_lm_server_cmd, *COMMON, "--hot-cache-only", *QUANT,
                            "--kv-cache-quantization-policy", "pressure")
    return {"stock": run(stock, False), "always": run(always, True),
            "pressure": run(pressure, True), "server": pressure, "always_server": always}


def scrape(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_start_up_line_names_the_policy(runs):
    assert "policy pressure" in runs["server"].log_text()
    assert "policy always" in runs["always_server"].log_text()


def test_entries_are_demoted_not_evicted(runs):
    stats = runs["server"].get("/kvplugin/stats")
    assert stats["quantization"]["policy"] == "pressure"
    assert stats["demotions"] > 0 and stats["bytes_saved_by_demotion"] > 0
    assert stats["store_bytes"] <= BUDGET
    full = [e for e in stats["entries"] if all(b is None for b in e["bits"])]
    assert full and len(full) < len(stats["entries"])  # which are quantized depends on load
    metrics = scrape(runs["server"])
    assert metrics["kvplugin_demotions_total"] == stats["demotions"]
    assert metrics["kvplugin_hits_full_total"] == stats["hits_full"] >= 1
    assert metrics["kvplugin_hits_demoted_total"] == stats["hits_demoted"]
    assert runs["always_server"].get("/kvplugin/stats")["demotions"] == 0


def test_a_full_precision_hit_answers_as_stock(runs):
    """The conversation that stored its turn last is served at full precision: stock's
    answer (``always`` answers with the codec's)."""
    full_hits = [i for i, (_, reused, full) in runs["pressure"].items() if full]
    assert full_hits  # the newest conversation's entry was still at full precision
    for i in full_hits:
        assert runs["pressure"][i][1] >= KEPT
        assert runs["pressure"][i][0] == runs["stock"][i][0], i


def test_it_keeps_at_least_the_conversations_always_keeps(runs):
    kept = {name: sum(reused >= KEPT for _, reused, _ in runs[name].values())
            for name in ("always", "pressure")}
    assert kept["pressure"] >= kept["always"] >= 1, kept
    assert kept["pressure"] > FP16_HOLDS, kept  # more than the budget holds at full precision
