"""``--kv-cache-quantization-policy pressure`` on a real mlx_lm.server: entries stay at full
precision while the budget holds them and are demoted (quantized in place) when it does not,
before any is evicted. Five conversations whose fp16 entries overflow the budget but fit it
quantized at 4 bits: the server demotes (``/kvplugin/stats``, ``/metrics``), a hit on a
full-precision entry answers as stock does (``always`` answers with the codec's), and it keeps
at least the conversations ``always`` keeps."""

from __future__ import annotations

import harness
import pytest
import pressure_workload as w

# bytes: 4 of these conversations' fp16 entries (~150 KB each), all 5 at 4 bits with room left
# for the newest at full precision and the next request's cache (the worker keeps that room:
# mlx-lm's batched path trims the store by the live cache at admission, which evicts)
BUDGET = 700_000
FP16_HOLDS = 4
WORDS = 80
QUANT = ("--kv-cache-quantization-bits", "4", "--kv-cache-min-quantize-tokens", "0",
         "--kv-cache-sink-tokens", "8")  # the chat template's first tokens stay exact
COMMON = ("--prompt-cache-bytes", str(BUDGET), "--prompt-cache-size", "50")


@pytest.fixture(scope="module")
def runs(start_server):
    stock = start_server(harness.mlx_lm_server_cmd, *COMMON, env={"KVPLUGIN_DISABLE": "1"})
    always = start_server(harness.mlx_lm_server_cmd, *COMMON, "--hot-cache-only", *QUANT)
    pressure = start_server(harness.mlx_lm_server_cmd, *COMMON, "--hot-cache-only", *QUANT,
                            "--kv-cache-quantization-policy", "pressure")
    return {"stock": w.run(stock, False, words=WORDS), "always": w.run(always, True, words=WORDS),
            "pressure": w.run(pressure, True, words=WORDS), "server": pressure,
            "always_server": always}


def test_the_start_up_line_names_the_policy(runs):
    assert "policy pressure" in runs["server"].log_text()
    assert "policy always" in runs["always_server"].log_text()


def test_entries_are_demoted_not_evicted(runs):
    w.check_demoted_not_evicted(runs["server"], runs["always_server"], BUDGET)


def test_a_full_precision_hit_answers_as_stock(runs):
    w.check_full_hits_answer_as_stock(runs["pressure"], runs["stock"])
    assert runs["always"] != runs["stock"]  # the same hits at 8 bits: the codec's answers


def test_it_keeps_at_least_the_conversations_always_keeps(runs):
    w.check_kept(runs["pressure"], runs["always"], FP16_HOLDS)
