"""``--max-kv-size`` entries cross Redis into a real ``vllm-mlx serve`` (default mode): a bounded
entry an ``mlx_lm.server`` replica stored is a hit on the vllm-mlx replica, whose continuation
answers exactly as a vllm-mlx server with the same bound and no tier (fp16)."""

from __future__ import annotations

import harness
from harness import answer_text, vllm_mlx_serve_cmd

N = "256"
MAX_TOKENS = 8


def test_a_bounded_entry_from_an_mlx_lm_replica_is_a_hit_on_vllm_mlx(start_server,
                                                                        redis_server):
    remote = ("--max-kv-size", N, "--kv-cache-remote", redis_server.url)
    reference = start_server(vllm_mlx_serve_cmd, "--max-kv-size", N)
    writer = start_server(harness.mlx_lm_server_cmd, *remote)
    reader = start_server(vllm_mlx_serve_cmd, *remote)
    first = [harness.briefing(6), {"role": "user", "content": "Tell me about the bridge."}]
    want_first = reference.chat(first, max_tokens=MAX_TOKENS)
    assert want_first["usage"]["prompt_tokens"] > int(N)
    second = first + [{"role": "assistant", "content": answer_text(want_first)},
                      {"role": "user", "content": "And what happened next?"}]
    want_second = reference.chat(second, max_tokens=MAX_TOKENS)

    assert answer_text(writer.chat(first, max_tokens=MAX_TOKENS)) == answer_text(want_first)
    stats = harness.wait_published(writer, 1)
    assert stats["remote_refused"] == 0, stats["cold_tier"]
    got = reader.chat(second, max_tokens=MAX_TOKENS)
    stats = reader.get("/kvplugin/stats")
    assert stats["remote_hits"] >= 1, stats
    assert stats["store_tokens_reused"] > int(N), stats  # a wrapped entry, reused whole
    assert answer_text(got) == answer_text(want_second)
