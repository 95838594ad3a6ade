"""``--kv-cache-quantization-policy pressure`` on a real ``vllm-mlx serve``, in its default
(simple) mode and with ``--continuous-batching``: the same service code as mlx-lm, so the same
behaviour (see ``test_mlx_lm_pressure``): demotion instead of eviction, visible in
``/kvplugin/stats`` and ``/metrics``, a full-precision hit answering as stock, and at least
the conversations ``always`` keeps."""

from __future__ import annotations

import harness
import pytest
import pressure_workload as w

BUDGET = 1 << 20  # --cache-memory-mb 1: 3 of these conversations' fp16 entries, 5 at 8 bits
FP16_HOLDS = 3
WORDS = 140
QUANT = ("--kv-cache-quantization-bits", "8", "--kv-cache-min-quantize-tokens", "0",
         "--kv-cache-sink-tokens", "8", "--hot-cache-only")
COMMON = ("--cache-memory-mb", "1", "--enable-metrics")


@pytest.fixture(scope="module", params=["simple", "continuous-batching"])
def runs(request, start_server):
    mode = () if request.param == "simple" else ("--continuous-batching",)
    cmd = harness.vllm_mlx_serve_cmd
    stock = start_server(cmd, *COMMON, *mode, env={"KVPLUGIN_DISABLE": "1"})
    always = start_server(cmd, *COMMON, *mode, *QUANT)
    pressure = start_server(cmd, *COMMON, *mode, *QUANT, "--kv-cache-quantization-policy",
                            "pressure")
    out = {"stock": w.run(stock, False, words=WORDS), "always": w.run(always, True, words=WORDS),
           "pressure": w.run(pressure, True, words=WORDS), "server": pressure,
           "always_server": always}
    stock.stop()
    return out


def test_entries_are_demoted_not_evicted(runs):
    assert "policy pressure" in runs["server"].log_text()
    w.check_demoted_not_evicted(runs["server"], runs["always_server"], BUDGET)


def test_a_full_precision_hit_answers_as_stock(runs):
    w.check_full_hits_answer_as_stock(runs["pressure"], runs["stock"])


def test_it_keeps_at_least_the_conversations_always_keeps(runs):
    w.check_kept(runs["pressure"], runs["always"], FP16_HOLDS)
