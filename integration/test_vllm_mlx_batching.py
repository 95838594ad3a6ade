"""``vllm-mlx serve --continuous-batching`` with kvplugin backing the prefix cache.

Servers (module-scoped unless a test owns its lifecycle):

* ``stock`` -- ``KVPLUGIN_DISABLE=1``, one sequence at a time (reference answers).
* ``plain`` -- kvplugin at fp16 defaults, ``--enable-metrics``, one sequence at a time
  (``--prefill-batch-size 1 --completion-batch-size 1``) so that interleaved requests are
  numerically identical to sequential ones: on this random tiny model, batched attention with
  padding changes greedy tokens by itself (stock measured 7/10 equal with the prefix cache off).
* ``quant`` then ``quant_again`` -- quantization from flags (3 bits: outside vllm-mlx's own
  [4, 8]); clean shut-down, restart on the same HOME: the saved entry is found, still
  quantized, through kvplugin's SSD tier.
* ``hot`` -- ``KVPLUGIN_HOT_CACHE_ONLY=1`` with ``--max-kv-size 256`` and a 1 MiB budget.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import struct
from pathlib import Path

import harness
import pytest
from harness import answer_text, vllm_mlx_serve_cmd

from kvplugin.tools.models.corpus import CORPUS

CB = ("--continuous-batching",)
ONE_AT_A_TIME = ("--prefill-batch-size", "1", "--completion-batch-size", "1")
BOUND = 64
LONG = " ".join(CORPUS.split()[:120])  # ~160 tokens: past the bound
from vllm_workload import SYSTEM, assert_no_contamination, conversation, stats
from vllm_workload import workload as _workload


def workload(srv) -> list[str]:
    return _workload(srv, stream=False)


def start_in(tiny_model, workdir: Path, *extra: str, env=None) -> harness.ServerProcess:
    """A server whose HOME (``workdir/home``) a later server can reuse (restart)."""
    port = harness.free_port()
    srv = harness.ServerProcess(
        vllm_mlx_serve_cmd(tiny_model, port, *extra), port=port, env=env,
        model=harness.SERVED_MODEL_NAME, workdir=workdir,
    )
    return srv.start()


def safetensors_metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__", {})


@pytest.fixture(scope="module")
def stock(start_server):
    return start_server(vllm_mlx_serve_cmd, *CB, *ONE_AT_A_TIME, env={"KVPLUGIN_DISABLE": "1"})


@pytest.fixture(scope="module")
def plain(start_server):
    return start_server(vllm_mlx_serve_cmd, *CB, *ONE_AT_A_TIME, "--enable-metrics")


QUANT_FLAGS = (
    *CB,
    "--kv-cache-quantization",
    "--kv-cache-quantization-bits", "3",
    "--kv-cache-min-quantize-tokens", "200",
)


@pytest.fixture(scope="module")
def quant_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quant-server")


def test_greedy_answers_identical_to_stock_at_fp16_defaults(stock, plain):
    expected = workload(stock)
    assert workload(plain) == expected
    s = stats(plain)
    assert s["store_hits"] >= 8, s
    assert s["entries_quantized"] == 0 and set(s["store_bytes_by_kind"]) == {"KVCache"}, s


def test_no_contamination_across_interleaved_concurrent_requests(stock, plain):
    """24 requests: 12 two-turn conversations sharing a 240-token prefix, all at once."""
    assert_no_contamination(stock, plain)


def test_metrics_show_kvplugin_counters_that_move(plain):
    def scrape() -> dict[str, float]:
        status, text = plain.request("GET", "/metrics")
        assert status == 200, text
        return {
            name: float(value)
            for name, value in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln.startswith("kvplugin_"))
        }

    before = scrape()
    conversation(plain, 900)
    after = scrape()
    assert after["kvplugin_entries_stored_total"] >= before["kvplugin_entries_stored_total"] + 2
    assert after["kvplugin_hits_total"] > before["kvplugin_hits_total"]  # turn 2 + shared prefix
    assert after["kvplugin_bytes_saved_total"] >= before["kvplugin_bytes_saved_total"]
    assert "kvplugin_spills_total" in after and "kvplugin_evictions_total" in after


def test_flags_quantize_entries_with_the_chosen_bits(tiny_model, quant_home):
    srv = start_in(tiny_model, quant_home, *QUANT_FLAGS)
    try:
        _quantized_traffic_then_stop(srv, quant_home)
    finally:
        srv.stop()


def _quantized_traffic_then_stop(srv, quant_home):
    for i in range(4):
        conversation(srv, i)
    # real batching: 8 more requests at once (answers are not compared, see module doc)
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: conversation(srv, i, turns=1), range(20, 28)))
    assert all(a and a[0] for a in answers)
    s = stats(srv)
    assert s["quantization"] == {"bits": 3, "group_size": 64, "min_tokens": 200,
        # the default codec at 3 bits (auto): keys per channel, values with a scale and no
        # minimum, 4 sink + 6 recent tokens kept
        "codec": "rotated-channel-sym", "codec_setting": "auto", "key_bits": 3,
        "value_bits": 3, "sink_tokens": 4, "recent_tokens": 6,
        "wide_head_keys": [4, 2, 128],  # on heads 128 divides (none here), with a window
        "window_codec": None, "ranked_key_bits": None,  # key ranking is a 4-bit choice
        "policy": "always"}, s
    assert s["entries_quantized"] >= 8, s
    assert s["bytes_stored"] < 0.5 * s["bytes_before"], s  # 3-bit: ~0.22 + protected tokens
    assert all(e["nbytes"] <= harness.quantized_size_bound(e, s["quantization"])
               for e in s["entries"]), s["entries"]
    assert set(s["store_bytes_by_kind"]) == {"QuantizedKVCache"}, s
    assert s["entries"] and all(e["bits"] == [3, 3] for e in s["entries"]), s["entries"]
    assert s["mode"] == "continuous-batching"
    assert s["store_hits"] >= 4, s
    # clean shut-down: vllm-mlx saves its prefix cache; with kvplugin that is our SSD tier
    srv.stop()
    files = sorted((quant_home / "home").rglob("*.safetensors"))
    assert files, "nothing saved at shut-down"
    assert all(PERSIST in f.parts for f in files), files
    for f in files:
        layers = json.loads(safetensors_metadata(f)["layers"])
        assert {lay["kind"] for lay in layers} == {"QuantizedKVCache"}, layers
        assert {lay["attrs"]["bits"] for lay in layers} == {3}, layers
        assert {lay["attrs"]["kvplugin_codec"] for lay in layers} == {"rotated-channel-sym"}


PERSIST = "kvplugin"


def test_restart_finds_the_saved_entry_still_quantized(tiny_model, quant_home):
    srv = start_in(tiny_model, quant_home, *QUANT_FLAGS)
    try:
        _restart_checks(srv)
    finally:
        srv.stop()


def _restart_checks(srv):
    s = stats(srv)
    assert s["store_cold_entries"] >= 1, s
    # conversation 0's second turn extends an entry saved by the previous process
    history = [SYSTEM, {"role": "user", "content": "Visitor 0 asks (0): what about bed 0?"}]
    r = srv.chat(history, max_tokens=10)
    assert answer_text(r)
    s = stats(srv)
    assert s["store_cold_hits"] >= 1, s
    assert s["store_tokens_reused"] >= r["usage"]["prompt_tokens"] - 2, (s, r["usage"])
    assert "cached=" in srv.log_text()  # vllm-mlx logged the hit: "[cache_fetch] ... HIT"
    # back in the hot tier after the request, quantized again
    assert s["store_bytes_by_kind"].get("QuantizedKVCache", 0) > 0, s
    assert set(s["store_bytes_by_kind"]) == {"QuantizedKVCache"}, s


@pytest.mark.parametrize("extra, env", [
    (("--max-kv-size", str(BOUND)), None),
    ((), {"KVPLUGIN_MAX_KV_SIZE": str(BOUND)}),
], ids=["flag", "env"])
def test_a_bounded_cache_keeps_the_first_tokens_like_mlx_lm(start_server, tiny_model, extra, env):
    """vllm-mlx's own bounded batch cache (``RotatingKVCache(n)``) keeps no first tokens;
    kvplugin's keeps 4, so requests and a repeat from the stored entry answer like mlx-lm's
    ``RotatingKVCache(n, keep=4)``. One sequence at a time (see the module docstring: padding
    alone moves this random model's tokens); the real-model test batches two at once."""
    messages = [{"role": "user", "content": LONG}]
    n_prompt, reference = harness.bounded_reference(tiny_model, messages, BOUND, 16)
    assert n_prompt > BOUND + 50, n_prompt
    srv = start_server(vllm_mlx_serve_cmd, *CB, *ONE_AT_A_TIME, *extra, env=env)
    with cf.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: srv.chat(messages, max_tokens=16), range(2)))
    again = srv.chat(messages, max_tokens=16)
    s = stats(srv)
    srv.stop()
    assert s["max_kv_size"] == BOUND and s["caches_bounded"] >= 1, s
    assert again["usage"]["prompt_tokens"] == n_prompt
    assert [answer_text(r) for r in both + [again]] == [reference] * 3


def test_hot_cache_only_writes_nothing(tiny_model, tmp_path):
    srv = start_in(
        tiny_model, tmp_path, *CB, "--cache-memory-mb", "1", "--max-kv-size", "256",
        env={"KVPLUGIN_HOT_CACHE_ONLY": "1"},
    )
    try:
        _hot_only_checks(srv)
    finally:
        srv.stop()


def _hot_only_checks(srv):
    for i in range(6):
        conversation(srv, i)
    with cf.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: conversation(srv, i, turns=1), range(30, 36)))
    s = stats(srv)
    assert s["hot_cache_only"] is True and s["max_kv_size"] == 256, s
    assert s["store_entries"] >= 1, s
    assert s["store_bytes"] <= 1 << 20, s  # the 1 MiB budget
    assert s["store_evictions"] >= 1 and s["store_discarded"] == s["store_evictions"], s
    srv.stop()
    leftovers = [
        os.path.relpath(os.path.join(d, f), srv.home)
        for d, _, files in os.walk(srv.home)
        for f in files
    ]
    assert leftovers == [], leftovers
    assert not (srv.home / ".cache" / "vllm-mlx").exists()
    assert "Saving prefix cache" not in srv.log_text() or "Saved prefix cache" not in srv.log_text()
