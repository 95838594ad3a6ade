"""kvplugin changes memory, not answers: the same greedy requests give the same text as the
stock server, also when conversations sharing a long system prompt run interleaved and
concurrently on kvplugin (no contamination between them).

Two servers for the module: stock (``KVPLUGIN_DISABLE=1``, the ``mlx_lm.server`` script) and
kvplugin at its defaults (started as ``python -m mlx_lm server``, the other supported form).
Requests without a seed take mlx-lm's batched path, requests with a seed the sequential one.
"""

from __future__ import annotations

import threading

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools.models.corpus import CORPUS

MAX_TOKENS = 8
PARAGRAPHS = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]
SYSTEM = "You answer questions about the town. Background: " + " ".join(PARAGRAPHS[:3])
QUESTIONS = [
    "Tell me about the bridge.",
    "When does the bakery open?",
    "What is sold on market days?",
    "Who repaired the bridge after the flood?",
    "Why must boats wait for low water?",
    "Describe the morning mist.",
    "Where do the buses go?",
    "How many arches are there?",
]


@pytest.fixture(scope="module")
def stock(start_server):
    return start_server(harness.mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"})


@pytest.fixture(scope="module")
def kv(start_server):
    return start_server(harness.mlx_lm_module_cmd)


def _chat(srv, messages, seed=None):
    return srv.chat(messages, max_tokens=MAX_TOKENS, temperature=0.0, seed=seed)


def _script(srv) -> list[dict]:
    """A fixed request sequence with repeats and extended conversations on both paths."""
    out = []
    system = {"role": "system", "content": SYSTEM}
    for seed in (None, 0):  # batched, then sequential
        single = [system, {"role": "user", "content": QUESTIONS[0]}]
        out += [_chat(srv, single, seed), _chat(srv, single, seed)]  # repeat: a cache hit
        messages = [system]
        for question in QUESTIONS[1:4]:  # a conversation that grows turn by turn
            messages.append({"role": "user", "content": question})
            r = _chat(srv, messages, seed)
            out.append(r)
            messages.append({"role": "assistant", "content": answer_text(r)})
        out.append(_chat(srv, messages[:2], seed))  # back to an earlier prefix
    prompt = " ".join(PARAGRAPHS[3:6])
    out += [srv.complete(prompt, max_tokens=MAX_TOKENS) for _ in range(2)]
    out.append(srv.complete(prompt, max_tokens=MAX_TOKENS, seed=1))
    return out


def test_stock_server_has_no_kvplugin(stock):
    status, _ = stock.request("GET", "/kvplugin/stats")
    assert status == 404
    assert "kvplugin: disabled by KVPLUGIN_DISABLE" in stock.log_text()
    assert "kvplugin: active" not in stock.log_text()


def test_kvplugin_active_via_python_m(kv):
    assert "kvplugin: active on mlx-lm" in kv.log_text()
    stats = kv.get("/kvplugin/stats")
    assert stats["host"] == "mlx-lm"
    assert stats["quantization"] is None and stats["max_kv_size"] is None


def test_same_greedy_answers_as_stock(stock, kv):
    want = _script(stock)
    got = _script(kv)
    assert [answer_text(r) for r in got] == [answer_text(r) for r in want]
    assert all(answer_text(r).strip() for r in got)
    # the cache really served prefixes, on both paths
    hits = [cached_tokens(r) or 0 for r in got]
    assert hits[1] > 0 and hits[7] > 0, hits
    stats = kv.get("/kvplugin/stats")
    assert stats["store_hits"] >= 4, stats
    assert stats["entries_quantized"] == 0
    # stored entries are trimmed: exactly 1 KiB per token for the tiny model
    for e in stats["entries"]:
        assert e["nbytes"] == e["tokens"] * 1024, e


N_CONVERSATIONS = 4
N_TURNS = 5


def _conversation(srv, c: int, answers: list, barrier: threading.Barrier | None = None) -> None:
    """Conversation ``c``: N_TURNS user turns, each building on the previous answers.
    Odd conversations send a seed on odd turns (sequential path), the rest are batched."""
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(N_TURNS):
        question = QUESTIONS[(c + t) % len(QUESTIONS)] + f" (visitor {c}, question {t})"
        messages.append({"role": "user", "content": question})
        seed = 7 if (c % 2 and t % 2) else None
        if barrier is not None:
            barrier.wait(timeout=120)  # keep the conversations in lock-step: interleaved
        r = _chat(srv, messages, seed)
        answers.append(answer_text(r))
        messages.append({"role": "assistant", "content": answer_text(r)})


def test_no_contamination_between_concurrent_conversations(stock, kv):
    reference = []
    for c in range(N_CONVERSATIONS):  # each conversation alone on the stock server
        answers: list[str] = []
        _conversation(stock, c, answers)
        reference.append(answers)
    assert len({tuple(a) for a in reference}) == N_CONVERSATIONS  # they really differ

    before = kv.get("/kvplugin/stats")
    results: list[list[str]] = [[] for _ in range(N_CONVERSATIONS)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(N_CONVERSATIONS)

    def worker(c: int) -> None:
        try:
            _conversation(kv, c, results[c], barrier)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(N_CONVERSATIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sum(len(r) for r in results) == N_CONVERSATIONS * N_TURNS >= 20
    for c in range(N_CONVERSATIONS):
        assert results[c] == reference[c], f"conversation {c}"
    after = kv.get("/kvplugin/stats")
    assert after["store_hits"] > before["store_hits"]  # the shared prompt was reused
