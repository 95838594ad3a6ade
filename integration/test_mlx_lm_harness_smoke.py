"""Smoke test of the harness against a STOCK ``mlx_lm.server`` (kvplugin off)."""

from __future__ import annotations

import harness
from harness import answer_text, cached_tokens, mlx_lm_server_cmd, server_fixture

from kvplugin.tools.models.corpus import CORPUS

server = server_fixture(mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"})

LONG_PROMPT = CORPUS  # ~1750 tokens with the tiny model's tokenizer


def test_host_installed():
    assert harness.host_version("mlx-lm")


def test_chat_answers_greedily(server):
    a = server.chat("Hello, who are you?", max_tokens=12, temperature=0)
    text = answer_text(a)
    assert text.strip(), a
    assert a["usage"]["completion_tokens"] == 12  # the tiny model never stops by itself
    assert a["choices"][0]["finish_reason"] == "length"
    b = server.chat("Hello, who are you?", max_tokens=12, temperature=0)
    assert answer_text(b) == text  # greedy is deterministic
    c = server.chat("Tell me about the bridge.", max_tokens=12, temperature=0)
    assert answer_text(c) != text  # ...and depends on the prompt


def test_completion(server):
    r = server.complete("The town sits where", max_tokens=5)
    assert answer_text(r).strip(), r


def test_repeated_long_prompt_is_cached(server):
    messages = [{"role": "user", "content": LONG_PROMPT}]
    first = server.chat(messages, max_tokens=4)
    n_prompt = first["usage"]["prompt_tokens"]
    assert n_prompt >= 1000, first["usage"]
    assert (cached_tokens(first) or 0) < n_prompt // 2, first["usage"]
    second = server.chat(messages, max_tokens=4)
    assert second["usage"]["prompt_tokens"] == n_prompt
    # mlx-lm reports usage.prompt_tokens_details.cached_tokens (0.31.x and 0.32.x);
    # an exact repeat re-processes only the last prompt token.
    assert cached_tokens(second) == n_prompt - 1, second["usage"]
    assert answer_text(second) == answer_text(first)


def test_stop_returns_and_leaves_nothing(tiny_model, tmp_path):
    port = harness.free_port()
    srv = harness.ServerProcess(mlx_lm_server_cmd(tiny_model, port),
                                env={"KVPLUGIN_DISABLE": "1"}, workdir=tmp_path)
    with srv:
        assert srv.is_running()
        assert srv.get("/health") == {"status": "ok"}
    assert srv.returncode is not None and not srv.is_running()
    assert "--model" in srv.log_text().splitlines()[0]  # the log keeps the command line
