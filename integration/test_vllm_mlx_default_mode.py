"""``vllm-mlx serve`` in its default (simple) mode with kvplugin: the flags take effect.

Stock vllm-mlx ignores every KV-cache flag in this mode. With kvplugin the
prompt cache of every pure-LLM request is kvplugin's store. Servers (one each, module-scoped):

* ``stock``   -- ``KVPLUGIN_DISABLE=1``: the reference answers.
* ``plain``   -- kvplugin at fp16 defaults, ``--enable-metrics``.
* ``quant``   -- quantization from env variables (bits from the flag: flag beats env),
  ``--hot-cache-only`` from its env variable, a 1 MiB store budget (evictions happen).
* ``bounded`` -- ``--max-kv-size 256``: bounded rotating caches.
"""

from __future__ import annotations

import os

import pytest
import harness
from harness import answer_text, vllm_mlx_serve_cmd
from vllm_workload import assert_no_contamination, conversation, stats, workload

# Simple mode answers "busy" (503) to a request arriving while another runs unless told to wait.
WAIT = {"VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION": "wait"}


@pytest.fixture(scope="module")
def stock(start_server):
    return start_server(vllm_mlx_serve_cmd, env={"KVPLUGIN_DISABLE": "1", **WAIT})


@pytest.fixture(scope="module")
def plain(start_server):
    return start_server(vllm_mlx_serve_cmd, "--enable-metrics", env=WAIT)


@pytest.fixture(scope="module")
def quant(start_server):
    env = {
        "KVPLUGIN_KV_CACHE_QUANTIZATION": "1",
        "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS": "8",  # the flag below wins
        "KVPLUGIN_KV_CACHE_MIN_QUANTIZE_TOKENS": "300",
        "KVPLUGIN_HOT_CACHE_ONLY": "1",
        **WAIT,
    }
    return start_server(
        vllm_mlx_serve_cmd, "--kv-cache-quantization-bits", "4", "--cache-memory-mb", "1", env=env
    )


@pytest.fixture(scope="module")
def bounded(start_server):
    return start_server(vllm_mlx_serve_cmd, "--max-kv-size", "256", env=WAIT)


def test_greedy_answers_identical_to_stock_at_fp16_defaults(stock, plain):
    expected = workload(stock)
    got = workload(plain)
    assert got == expected
    s = stats(plain)
    assert s["store_hits"] >= 8, s  # the identity held while the cache was reused
    assert s["entries_quantized"] == 0 and s["quantization"] is None
    assert set(s["store_bytes_by_kind"]) == {"KVCache"}, s


def test_no_contamination_across_concurrent_conversations(stock, plain):
    """24 requests (12 two-turn conversations sharing a 240-token prefix) interleaved."""
    assert_no_contamination(stock, plain)


def test_metrics_show_kvplugin_counters_that_move(plain):
    def scrape() -> dict[str, float]:
        status, text = plain.request("GET", "/metrics")
        assert status == 200, text
        values = {}
        for line in text.splitlines():
            if line.startswith("kvplugin_"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    for name in ("kvplugin_entries_stored_total", "kvplugin_entries_quantized_total",
                 "kvplugin_bytes_saved_total", "kvplugin_hits_total", "kvplugin_misses_total",
                 "kvplugin_evictions_total", "kvplugin_spills_total", "kvplugin_entries"):
        assert name in before, sorted(before)
    conversation(plain, 500, turns=2)
    after = scrape()
    assert after["kvplugin_entries_stored_total"] >= before["kvplugin_entries_stored_total"] + 2
    assert after["kvplugin_hits_total"] + after["kvplugin_misses_total"] >= (
        before["kvplugin_hits_total"] + before["kvplugin_misses_total"] + 2
    )
    assert after["kvplugin_bytes_saved_total"] > before["kvplugin_bytes_saved_total"]


def test_env_and_flags_quantize_entries_with_the_chosen_bits(quant):
    # 12 conversations (was 6): each one's second turn now supersedes its first, so 6 no
    # longer fill the 1 MiB budget that the eviction check below needs exceeded
    for i in range(12):
        conversation(quant, i)
    s = stats(quant)
    assert s["quantization"] == {"bits": 4, "group_size": 64, "min_tokens": 300,
        # the default codec at 4 bits (auto): keys per channel, 4 sink + 16 recent tokens kept
        "codec": "rotated-channel", "codec_setting": "auto", "key_bits": 4, "value_bits": 4,
        "sink_tokens": 4, "recent_tokens": 16, "wide_head_keys": [5, 4, 128], "window_codec": None,
        "ranked_key_bits": 6,  # for entries with a window (none on this model)
        "policy": "always"}, s
    assert s["hot_cache_only"] is True
    assert s["entries_quantized"] >= 6, s
    assert s["bytes_stored"] < 0.45 * s["bytes_before"], s  # 4-bit: ~0.28 + protected tokens
    assert all(e["nbytes"] <= harness.quantized_size_bound(e, s["quantization"])
               for e in s["entries"]), s["entries"]
    assert s["store_bytes_by_kind"].get("QuantizedKVCache", 0) > 0, s
    assert s["mode"] == "simple"
    assert any(e["bits"] == [4, 4] for e in s["entries"]), s["entries"]
    # the 1 MiB budget evicted entries, and with --hot-cache-only they were discarded
    assert s["store_evictions"] >= 1 and s["store_discarded"] == s["store_evictions"], s
    assert s["store_spills"] == 0 and s["store_cold_entries"] is None, s  # was -1: "not configured" is null
    short = quant.chat("short question about beds", max_tokens=4)  # < 300 tokens: stays fp16
    assert answer_text(short) is not None


def test_hot_cache_only_leaves_no_files_after_shutdown(quant):
    quant.stop()
    assert quant.returncode is not None
    leftovers = [
        os.path.relpath(os.path.join(d, f), quant.home)
        for d, _, files in os.walk(quant.home)
        for f in files
    ]
    assert leftovers == [], leftovers
    assert not (quant.home / ".cache" / "vllm-mlx").exists()


def test_max_kv_size_bounds_preallocated_caches(bounded):
    long_user = "tell me everything about the old bridge and the river. " * 40  # > 256 tokens
    for _ in range(2):
        r = bounded.chat(long_user, max_tokens=8)
        assert r["usage"]["prompt_tokens"] > 256 and answer_text(r)
    conversation(bounded, 7)
    s = stats(bounded)
    assert s["max_kv_size"] == 256
    assert s["caches_bounded"] >= 1, s
    assert set(s["store_bytes_by_kind"]) == {"PreallocatedRotatingKVCache"}, s
    # 2 layers x (K+V) x 2 heads x 64 x fp16 = 1 KiB per token: every entry <= 256 tokens
    assert s["store_bytes"] <= s["store_entries"] * 256 * 1024, s
