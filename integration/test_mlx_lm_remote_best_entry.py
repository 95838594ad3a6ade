"""A second ``mlx_lm.server`` replica gets from Redis the entry its own hot tier would choose.

Two replicas share one real ``redis-server``; a third server, alone and without the tier, runs
the same conversations. Replica one holds conversation A (two turns on a long system prompt);
replica two then serves a new conversation B on the system prompt (a cut: the system prompt's
own entry, which ends inside a pointer block, or a longer entry cut there) and A's third turn
(an extension: A's previous turn shares more than B's newer entry). On the tiny llama every
entry can be cut; on the tiny qwen3_next (recurrent layers) none can, so only an entry whose
whole key starts the prompt serves. Each of replica two's answers reuses at least what the
server alone reused, and says the same.
"""

from __future__ import annotations

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools.models.corpus import CORPUS
from kvplugin.tools.models.families import build_family_model

SYSTEM = {"role": "system", "content": " ".join(CORPUS.split()[:260])}  # ~430 tokens
A = ["Where is the river?", "And the hills?", "Who lives there?"]
B = "What grows in the garden?"
MAX_TOKENS = 12


def _conversations(first, second) -> list[dict]:
    """A's two turns on ``first``; B, then A's third turn, on ``second``: the responses."""
    history, out = [SYSTEM], []
    for q in A[:2]:
        history.append({"role": "user", "content": q})
        r = first.chat(history, max_tokens=MAX_TOKENS)
        out.append(r)
        history.append({"role": "assistant", "content": answer_text(r)})
    if first is not second:  # A's second turn's entry is in Redis
        harness.wait_published(first, 2, tokens=out[-1]["usage"]["prompt_tokens"])
    out.append(second.chat([SYSTEM, {"role": "user", "content": B}], max_tokens=MAX_TOKENS))
    if first is not second:  # B's entries are in Redis (newer than A's) before A goes on
        harness.wait_published(second, 1, tokens=out[-1]["usage"]["prompt_tokens"])
    history.append({"role": "user", "content": A[2]})
    out.append(second.chat(history, max_tokens=MAX_TOKENS))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_the_second_replica_reuses_what_one_server_alone_reuses(
        family, start_server, redis_server, tiny_model, tmp_path_factory):
    model = tiny_model if family == "llama" else build_family_model(
        family, tmp_path_factory.mktemp(family) / "m")
    alone = start_server(harness.mlx_lm_server_cmd, model_dir=model)
    one, two = (start_server(harness.mlx_lm_server_cmd, "--kv-cache-remote", redis_server.url,
                             model_dir=model) for _ in range(2))
    want = _conversations(alone, alone)
    got = _conversations(one, two)
    assert [answer_text(r) for r in got] == [answer_text(r) for r in want]
    reused = [cached_tokens(r) or 0 for r in got]
    alone_reused = [cached_tokens(r) or 0 for r in want]
    why = (family, reused, alone_reused, {k: v for k, v in two.get("/kvplugin/stats").items()
                                          if k.startswith(("remote_", "store_", "entries"))})
    # B's cut: the system prompt's tokens came from Redis (replica two never saw them)
    assert alone_reused[2] >= 0.8 * (got[2]["usage"]["prompt_tokens"] - 16), why
    assert reused[2] >= alone_reused[2], why
    # A's extension: as much as the hot tier that held A's turns reused
    assert reused[3] >= alone_reused[3], why
    assert two.get("/kvplugin/stats")["remote_hits"] >= 2, why
