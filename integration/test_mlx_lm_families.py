"""Every model family behind a real mlx_lm.server: stock vs kvplugin on the same workload.

Per family available on the installed mlx-lm (:mod:`kvplugin.tools.models.families`), the same
workload on a stock server, on kvplugin (fp16) and on kvplugin with
``--kv-cache-quantization``: a 3-turn conversation on a ~1k-token system prompt (:mod:`kvplugin.tools.bench.families`, which
``kvplugin bench --server --families`` also runs; longer than
the 128-token sliding windows and chunks, so they wrap), then two concurrent conversations on
the same system prompt, then a fourth. Checked: answers equal stock's, prompt tokens reused
>= stock's (the server's own ``usage.prompt_tokens_details.cached_tokens``), entries stored
(and quantized: K/V layers and recurrent state, a hybrid 8-bit entry >= 1.8x smaller), and no contamination (a concurrent conversation
answers as it does alone on stock).

Why: state-space (Mamba) and nested (Falcon-H1) entries used to be never stored; MLA
(DeepSeek-V3) with quantization used to stop the server; on sliding-window and recurrent
families the shared system-prompt entry was moved into one concurrent conversation and the
other missed, where stock deep-copies (kvplugin now serves it from the lent entry's snapshot).
"""

from __future__ import annotations

import re

import time

import harness
import pytest

from kvplugin.tools.bench.families import answers, conversation, reused, workload
from kvplugin.tools.models.families import FAMILIES, available, build_family_model

VERSION = harness.host_version("mlx-lm")
# The affordable list per host version (the matrix aims at 40 minutes): mlx-lm 0.32.1's
# server.py and models/cache.py are 0.32.2's byte for byte (0.32.2, the newest tested, runs
# every family), and of the families' model code only models/ssm.py differs, which falcon_h1
# builds on. 0.31.3 and 0.32.0 differ in the server, the cache classes or models/base.py:
# every family runs there.
ONLY = {"0.32.1": {"falcon_h1"}}
FAMS = [f for f in FAMILIES if available(f, VERSION) and f in ONLY.get(VERSION, FAMILIES)]
# layers holding K/V somewhere (quantized entries expected); the rest are recurrent-only
HAS_KV = {"deepseek_v3", "gemma3_text", "gpt_oss", "qwen3_next", "falcon_h1", "llama4"}
# recurrent state in every entry (quantized with the entry at 8 bits, --kv-cache-quantize-state)
RECURRENT = {"mamba", "qwen3_next", "falcon_h1"}
# Mamba ignores left padding when requests are batched, so even stock answers a batched
# conversation differently than alone: its contamination control cannot hold on any server.
NO_BATCH_CONTROL = {"mamba"}
# Falcon-H1's nested attention and Llama 4's chunked layers kept their 256-slot growth slack
# in the store until they were taught to kvplugin's trim (kvplugin.cache.layers)
CUT_EXACTLY = {"falcon_h1", "llama4"}


def per_turn(out: dict) -> dict:
    """Cached tokens per conversation and turn (what an assertion message shows)."""
    return {w: out[w][1] for w in sorted(out)}


@pytest.fixture(scope="module", params=FAMS)
def family(request, tmp_path_factory):
    return request.param, build_family_model(request.param,
                                             tmp_path_factory.mktemp(request.param) / "model")


def _stored(srv, n: int, timeout: float = 10.0) -> dict:
    """The stats once ``n`` entries are stored (or after ``timeout``: the assertion says)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.get("/kvplugin/stats")
        if stats["entries_stored"] >= n or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_family_is_stored_reused_and_answers_like_stock(family, start_server):
    name, model_dir = family
    servers = []

    def start(*extra, env=None):
        servers.append(start_server(harness.mlx_lm_server_cmd, *extra, env=env,
                                    model_dir=model_dir))
        return servers[-1]

    try:
        stock = start(env={"KVPLUGIN_DISABLE": "1"})
        want = workload(stock)
        alone: dict = {}  # the concurrent conversations, each alone on stock: the control
        for who in (1, 2):
            conversation(stock, who, 2, alone)

        ours = start()  # full precision: answers must equal stock's
        got = workload(ours)
        assert answers(got) == answers(want), name
        assert reused(got) >= reused(want) > 0, (name, per_turn(got), per_turn(want))
        if name not in NO_BATCH_CONTROL:  # no contamination between concurrent conversations
            assert [got[w][0] for w in (1, 2)] == [alone[w][0] for w in (1, 2)], name
        stats = _stored(ours, 9)  # mlx-lm answers before it stores the last entry
        assert stats["entries_stored"] >= 9 and stats["store_hits"] >= 5, stats
        assert stats["entries_rejected"] == 0, stats
        if name in CUT_EXACTLY:  # no growth slack stored (its own kinds: CacheList, chunked)
            from kvplugin.tools.bench.memory import entry_bytes

            # the sequential path (a seeded request) stores the request's own cache, grown
            # in 256-slot steps (the batched path's extracted caches are exact already)
            ours.chat("Say something about rivers.", max_tokens=8, seed=1)
            stats = _stored(ours, stats["entries_stored"] + 1)
            for e in stats["entries"]:
                full = entry_bytes(model_dir, e["tokens"])  # chunked: every token, a bound
                assert (e["nbytes"] <= full if name == "llama4" else e["nbytes"] == full), e

        quantized = start("--kv-cache-quantization", "--kv-cache-min-quantize-tokens", "0")
        qgot = workload(quantized)  # starts and serves: an MLA model is checked per width
        qstats = _stored(quantized, 8)
        assert qstats["entries_stored"] >= 8 and reused(qgot) >= reused(want), (qstats, qgot)
        # K/V layers (rotating and chunked included) and recurrent state: stored quantized
        assert qstats["entries_quantized"] >= 1, qstats
        if name in RECURRENT:  # 8-bit entries whose state is quantized too: >= 1.8x smaller
            full = {e["tokens"]: e["nbytes"] for e in stats["entries"]}
            same = [(e["nbytes"], full[e["tokens"]]) for e in qstats["entries"]
                    if e["tokens"] in full]
            assert same and all(q * 1.8 <= f for q, f in same), (name, same)
    finally:
        for srv in servers:  # one family's servers at a time
            srv.stop()


@pytest.mark.host_version("mlx-lm", ">=0.32.0")  # llama4 exists from mlx-lm 0.32.0 on
def test_bounded_chunked_conversation_says_why_its_next_turn_misses(start_server, tmp_path):
    """Llama 4 (ChunkedKVCache) with --max-kv-size: the full-attention layer is bounded to a
    wrapping window, which cannot be cut back to where the next prompt diverges (the reply
    re-tokenized): the start-up line says so, and the entries are stored, bounded."""
    srv = start_server(harness.mlx_lm_server_cmd, "--max-kv-size", "256",
                       model_dir=build_family_model("llama4", tmp_path / "model"))
    try:
        log = srv.log_text()
        assert "--max-kv-size 256: once a conversation passes 256 tokens" in log
        assert "cannot be cut back" in log and "is a miss" in log
        out: dict = {}
        conversation(srv, 0, 3, out)
        stats = _stored(srv, 3)  # mlx-lm answers before it stores the last entry
        assert stats["entries_stored"] >= 3 and stats["entries_rejected"] == 0, stats
        layers = {name for e in stats["entries"] for name in e["layers"]}
        assert "PreallocatedRotatingKVCache" in layers and "ChunkedKVCache" in layers, layers
        # what the line says: the reply came back re-tokenized, so the turns missed
        assert sum(out[0][1]) == stats["store_tokens_reused"], (out, stats)
    finally:
        srv.stop()


# what each width's default stores on a Gemma-3-shaped entry (windows first, then the global
# layers): at 4 bits every layer per channel with protected tokens (the wrapped windows, keep 0,
# their newest slots; the global layers their sinks too), keys pre-RoPE, the worst-quantized
# layer's keys at 6 bits and some at 3 (kvplugin.codecs.RANKED_KEYS); at 8 bits the window
# codec, post-RoPE, nothing protected (kvplugin.codecs.WINDOW_CODECS); and a budget that keeps
# the newest entry in memory and spills the one before
WINDOWED_CODEC = {
    "4": (r"(rotated-channel-k[346]v4-s[04]r16\+prerope\+?)+", "150000"),
    "8": ("rotated-channel-k8v8", "250000"),
}


@pytest.mark.parametrize("bits", sorted(WINDOWED_CODEC))
def test_sliding_window_entries_stored_quantized_spill_to_ssd_and_come_back(
        start_server, tmp_path, bits):
    """Gemma 3's sliding-window layers are stored quantized (QuantizedRotatingKVCache, with
    each width's default codec); the SSD tier used to refuse them. Now an evicted system-prompt
    entry spills, and a new server on the same directory serves the next conversation's system
    prompt from the file."""
    from kvplugin.tools.bench.families import SYSTEM

    model = build_family_model("gemma3_text", tmp_path / "model")
    ssd = tmp_path / "ssd"
    codec, budget = WINDOWED_CODEC[bits]
    flags = ("--kv-cache-quantization-bits", bits, "--kv-cache-min-quantize-tokens", "0",
             "--ssd-cache-dir", str(ssd), "--prompt-cache-bytes", budget)

    def ask(srv, question):
        return srv.chat([{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], max_tokens=8)

    first = start_server(harness.mlx_lm_server_cmd, *flags, model_dir=model)
    try:
        ask(first, "Where is the river?")  # stores the system prompt, then the whole turn
        stats = first.get("/kvplugin/stats")
        assert stats["store_spills"] >= 1 and stats["entries_quantized"] >= 2, stats
        assert stats["cold_tier"]["refused"] == 0, stats["cold_tier"]
        kinds = {k for e in stats["entries"] for k in e["layers"]}
        assert "QuantizedRotatingKVCache" in kinds, stats
        assert any(re.fullmatch(codec, c) for c in stats["bytes_stored_by_codec"]), stats
    finally:
        first.stop()
    second = start_server(harness.mlx_lm_server_cmd, *flags, model_dir=model)
    try:
        r = ask(second, "And the hills?")
        stats = second.get("/kvplugin/stats")
        assert stats["store_cold_hits"] == 1 and stats["cold_corrupt"] == 0, stats
        assert (r["usage"]["prompt_tokens_details"]["cached_tokens"] or 0) >= 700, r["usage"]
    finally:
        second.stop()
