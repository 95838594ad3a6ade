"""``--max-kv-size`` on a real model behind ``vllm-mlx serve``, in both modes: every request
gives mlx-lm's own ``RotatingKVCache(512, keep=4)`` answer. SmolLM2-135M (float32, OpenBLAS),
a ~900-token real-text prompt (the cache wraps).

- Default mode: a request, the same request again (served from the stored, wrapped entry) and
  one with a seed. It serves one request at a time (a concurrent one gets 503 from vllm-mlx).
- ``--continuous-batching``: two concurrent requests, shown to run in one batch (kvplugin's
  ``KeepingBatchRotatingKVCache``; vllm-mlx's own ``RotatingKVCache(n)`` keeps no first
  tokens), then the same request again (from the stored entry).
"""

from __future__ import annotations

import pytest
from harness import answer_text, streamed_pair, vllm_mlx_serve_cmd
from test_mlx_lm_max_kv_smollm2 import MAX_TOKENS, MESSAGES, N, _reference, smollm2_dir  # noqa: F401

from kvplugin.tools import blas

pytestmark = pytest.mark.real_model


def test_every_request_equals_mlx_lm(start_server, smollm2_dir):  # noqa: F811
    n_prompt, reference = _reference(smollm2_dir)
    srv = start_server(vllm_mlx_serve_cmd, "--max-kv-size", str(N), model_dir=smollm2_dir,
                       env=blas.preload_env())
    both = [srv.chat(MESSAGES, max_tokens=MAX_TOKENS) for _ in range(2)]
    single = srv.chat(MESSAGES, max_tokens=MAX_TOKENS, seed=3)
    stats = srv.get("/kvplugin/stats")
    srv.stop()
    assert single["usage"]["prompt_tokens"] == n_prompt
    assert stats["max_kv_size"] == N
    answers = [answer_text(r) for r in both + [single]]
    assert answers == [reference] * 3, (answers, reference)


def test_batching_mode_equals_mlx_lm(start_server, smollm2_dir):  # noqa: F811
    n_prompt, reference = _reference(smollm2_dir)
    srv = start_server(vllm_mlx_serve_cmd, "--continuous-batching", "--max-kv-size", str(N),
                       model_dir=smollm2_dir, env=blas.preload_env())
    batched = streamed_pair(srv, MESSAGES, MAX_TOKENS)
    again = srv.chat(MESSAGES, max_tokens=MAX_TOKENS)
    stats = srv.get("/kvplugin/stats")
    srv.stop()
    assert again["usage"]["prompt_tokens"] == n_prompt
    assert stats["max_kv_size"] == N and stats["caches_bounded"] >= 1, stats
    answers = batched + [answer_text(again)]
    assert answers == [reference] * 3, (answers, reference)
