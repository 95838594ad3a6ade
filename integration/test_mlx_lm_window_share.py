"""A system prompt shorter than a sliding window, shared after one conversation passed it.

Measured on a real Gemma 3 server (2026-12-07): conversation A went past the 512-token window
in its third turn; conversation B then opened on A's ~430-token system prompt and stock
reused 430 tokens, kvplugin none. Every entry A still held was wrapped (a wrapped window
cannot be cut back), and the last entry that could be cut, moved out by A's third turn, was
dropped at its insert because it was a finished turn's, where stock keeps it. With 4-bit
entries the cut was refused outright: a quantized window was never cut, wrapped or not.

Here the tiny gemma3_text family (128-token windows) on a real ``mlx_lm.server``: the answers
equal stock's at full precision, and every conversation's first turn reuses at least the
tokens stock's does, at full precision and with 4-bit entries.
"""

from __future__ import annotations

import harness
import pytest

from kvplugin.tools.client import stream_chat
from kvplugin.tools.models.corpus import CORPUS
from kvplugin.tools.models.families import build_family_model

SYSTEM = " ".join(CORPUS.split()[:22])  # A's second prompt inside the 128-token windows, its third past them
OTHER = " ".join(CORPUS.split()[300:340])


def conversation(srv, system: str, who: str, turns: int) -> tuple[list[str], list[int]]:
    messages: list[dict] = []
    answers, reused = [], []
    for t in range(turns):
        # the notes open the first user turn, as Gemma 3's template puts a system prompt there:
        # no system-prompt checkpoint of its own (mlx-lm's batched path stores one)
        ask = f"Visitor {who}, question {t + 1}: what comes next in the notes?"
        messages.append({"role": "user", "content": f"{system}\n\n{ask}" if not t else ask})
        r = stream_chat(srv, messages, max_tokens=24)
        answers.append(r.text)
        reused.append(r.cached_tokens or 0)
        messages.append({"role": "assistant", "content": r.text})
    return answers, reused


def workload(srv) -> dict[str, tuple[list[str], list[int]]]:
    """A passes the window; B shares A's system prompt; C has its own; A2 opens like A."""
    return {"A": conversation(srv, SYSTEM, "A", 4), "B": conversation(srv, SYSTEM, "B", 2),
            "C": conversation(srv, OTHER, "C", 2), "A2": conversation(srv, SYSTEM, "A", 1)}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return build_family_model("gemma3_text", tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture(scope="module")
def stock(gemma, start_server):
    srv = start_server(harness.mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"},
                       model_dir=gemma)
    try:
        return workload(srv)
    finally:
        srv.stop()


@pytest.mark.xfail(strict=True, reason="known gap: a finished turn's lent entry whose "
                   "continuation wrapped is dropped at its insert where stock keeps it; storing "
                   "it again broke the SSD tier's restart cell (test_mlx_lm_matrix, "
                   "sequential-gpt_oss-fp16-ssd), not yet understood")
@pytest.mark.parametrize("flags", [(), ("--kv-cache-quantization", "--kv-cache-quantization-bits",
                                        "4", "--kv-cache-min-quantize-tokens", "0")],
                         ids=["fp16", "4bit"])
def test_a_shared_prompt_inside_the_window_is_reused_after_a_conversation_passed_it(
        gemma, stock, start_server, flags):
    srv = start_server(harness.mlx_lm_server_cmd, *flags, model_dir=gemma)
    try:
        got = workload(srv)
        stats = srv.get("/kvplugin/stats")
    finally:
        srv.stop()
    window = 128
    a_tokens = sum(len(a) for a in got["A"][0])
    assert a_tokens > 0 and stock["A"][1][-1] > window, ("A passes the window", stock["A"])
    assert stock["B"][1][0] > 0, ("stock reuses the shared system prompt", stock)
    for who in got:  # the first turn of every conversation: stock's reuse at least
        assert got[who][1][0] >= stock[who][1][0], (who, got, stock)
    if not flags:  # the same answers, so the same later prompts: every turn compares
        assert {w: a for w, (a, _) in got.items()} == {w: a for w, (a, _) in stock.items()}
        assert sum(sum(r) for _, r in got.values()) >= sum(sum(r) for _, r in stock.values())
    else:  # a 4-bit answer may differ, and the next prompt with it: first turns only
        assert stats["entries_quantized"] >= 1, stats


LONG = " ".join(CORPUS.split()[:300])  # a system prompt past the 128-token windows


def test_a_system_prompt_checkpoint_outlives_other_turns_at_the_entry_cap(gemma, start_server):
    """mlx-lm's batched path stores a system-prompt checkpoint beside each conversation's
    turns, and at its 10-entry cap evicts assistant turns first (``CacheOrder``). With one
    plain LRU the store evicted the checkpoint: a conversation opening as an earlier one did
    reused 0 tokens where stock reused the whole system prompt (measured on this model)."""
    def chats(srv) -> list[tuple[str, int]]:
        out = []
        for who, system in (("A", LONG), ("B", LONG), ("C", OTHER), ("A", LONG)):
            messages = [{"role": "system", "content": system}]
            for t in range(3):
                messages.append({"role": "user", "content": f"{who} question {t + 1}?"})
                r = stream_chat(srv, messages, max_tokens=24)
                messages.append({"role": "assistant", "content": r.text})
                out.append((r.text, r.cached_tokens or 0))
        return out

    servers = [start_server(harness.mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"},
                            model_dir=gemma)]
    try:
        want = chats(servers[0])
        servers[0].stop()
        servers.append(start_server(harness.mlx_lm_server_cmd, model_dir=gemma))
        got = chats(servers[1])
    finally:
        for srv in servers:
            srv.stop()
    assert want[9][1] > 128, ("stock reuses the system prompt at the last conversation", want)
    assert [a for a, _ in got] == [a for a, _ in want]
    assert all(g >= w for (_, g), (_, w) in zip(got, want)), (got, want)
