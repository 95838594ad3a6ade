"""Other model families behind a real mlx_lm.server: stock vs kvplugin on the same chat.

State-space (Mamba: ``ArraysCache`` only) entries used to be never stored; MLA (DeepSeek-V3)
with ``--kv-cache-quantization`` used to stop the server (the group size was checked against
hidden/heads = 56 instead of the cache's real widths). Per family: answers equal stock's,
prompt tokens reused >= stock's, entries stored (and quantized where the layers allow).
"""

from __future__ import annotations

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools.models.corpus import CORPUS
from kvplugin.tools.models.families import FAMILIES, available, build_family_model

VERSION = harness.host_version("mlx-lm")
FAMS = [f for f in FAMILIES if available(f, VERSION)]
SYSTEM = " ".join(CORPUS.split()[:400])
QUESTIONS = ["Where is the river?", "And the hills?", "Who lives there?"]


def chat(srv) -> tuple[list[str], list[int]]:
    messages = [{"role": "system", "content": SYSTEM}]
    answers, reused = [], []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        r = srv.chat(messages, max_tokens=8)
        answers.append(answer_text(r))
        reused.append(cached_tokens(r) or 0)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers, reused


@pytest.fixture(scope="module", params=FAMS)
def family(request, tmp_path_factory):
    return request.param, build_family_model(request.param,
                                             tmp_path_factory.mktemp(request.param) / "model")


def test_family_is_stored_reused_and_answers_like_stock(family, start_server):
    name, model_dir = family
    stock = start_server(harness.mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"},
                         model_dir=model_dir)
    ours = start_server(harness.mlx_lm_server_cmd, "--kv-cache-min-quantize-tokens", "0",
                        model_dir=model_dir)
    want, stock_reused = chat(stock)
    got, reused = chat(ours)
    assert got == want, name
    assert sum(reused) >= sum(stock_reused) and sum(reused) > 0, (name, reused, stock_reused)
    stats = ours.get("/kvplugin/stats")
    assert stats["entries_stored"] >= len(QUESTIONS) and stats["store_hits"] >= 1, stats
    quantized = start_server(harness.mlx_lm_server_cmd, "--kv-cache-quantization",
                             "--kv-cache-min-quantize-tokens", "0", model_dir=model_dir)
    chat(quantized)  # starts and serves: an MLA model is checked against its real widths
    qstats = quantized.get("/kvplugin/stats")
    if name == "deepseek_v3":  # K/V layers: stored quantized
        assert qstats["entries_quantized"] >= 1, qstats
    else:  # recurrent state stays full precision, and is still stored
        assert qstats["entries_stored"] >= len(QUESTIONS) and qstats["entries_quantized"] == 0
