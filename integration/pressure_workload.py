"""The workload of the pressure-policy integration tests (one definition for both hosts):
conversations whose fp16 entries overflow the budget but fit it quantized, their second
turns newest first."""

from __future__ import annotations

import time
import urllib.request

import harness
from prometheus_client.parser import text_string_to_metric_families

from kvplugin.tools.models.corpus import CORPUS

WORDS = CORPUS.split()
KEPT = 40  # prompt tokens a later turn reuses when its conversation's entry was kept


def first_turn(i: int, words: int) -> list[dict]:
    start = (i * 53) % (len(WORDS) - words)
    return [{"role": "user", "content": f"Story {i}: " + " ".join(WORDS[start:start + words])}]


def second_turn(i: int, words: int, answer: str) -> list[dict]:
    return [*first_turn(i, words), {"role": "assistant", "content": answer},
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


def run(srv, kv: bool, *, words: int, conversations: int = 5) -> dict:
    """Both turns of every conversation (second turns newest first); per second turn its
    answer, the prompt tokens reused and whether a full-precision entry served it."""
    answers = {}
    stats = srv.get("/kvplugin/stats") if kv else None
    for i in range(conversations):
        answers[i] = harness.answer_text(srv.chat(first_turn(i, words), max_tokens=8))
        stats = stored(srv, stats) if kv else None
    out = {}
    for i in reversed(range(conversations)):
        text = harness.answer_text(srv.chat(second_turn(i, words, answers[i]), max_tokens=8))
        if kv:
            after = stored(srv, stats)
            out[i] = (text, after["store_tokens_reused"] - stats["store_tokens_reused"],
                      after["hits_full"] - stats["hits_full"])
            stats = after
        else:
            out[i] = (text, None, None)
    return out


def scrape(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def check_demoted_not_evicted(srv, always, budget: int) -> None:
    """Entries were demoted (some were hit at full precision first), and ``/metrics`` says so."""
    stats = srv.get("/kvplugin/stats")
    assert stats["quantization"]["policy"] == "pressure"
    assert stats["demotions"] > 0 and stats["bytes_saved_by_demotion"] > 0
    assert stats["store_bytes"] <= budget
    assert any(all(b is not None for b in e["bits"]) for e in stats["entries"])  # demoted
    metrics = scrape(srv)
    assert metrics["kvplugin_demotions_total"] == stats["demotions"]
    assert metrics["kvplugin_demotions_at_insert_total"] == stats["demotions_at_insert"]
    assert metrics["kvplugin_hits_full_total"] == stats["hits_full"] >= 1
    assert metrics["kvplugin_hits_demoted_total"] == stats["hits_demoted"]
    assert always.get("/kvplugin/stats")["demotions"] == 0
    assert "demoting an entry failed" not in srv.log_text()  # the worker thread's codec ran


def check_full_hits_answer_as_stock(pressure: dict, stock: dict) -> None:
    """The conversation that stored its turn last is served at full precision: stock's answer."""
    full_hits = [i for i, (_, reused, full) in pressure.items() if full and reused >= KEPT]
    assert full_hits, pressure  # the newest conversation's entry was still at full precision
    for i in full_hits:
        assert pressure[i][0] == stock[i][0], i


def check_kept(pressure: dict, always: dict, fp16_holds: int) -> None:
    """At least the conversations ``always`` keeps, more than the budget holds at fp16."""
    kept = {name: sum(reused >= KEPT for _, reused, _ in run.values())
            for name, run in (("always", always), ("pressure", pressure))}
    assert kept["pressure"] >= kept["always"] >= 1, (kept, pressure, always)
    assert kept["pressure"] > fp16_holds, kept
