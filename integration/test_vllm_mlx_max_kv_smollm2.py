"""``--max-kv-size`` on a real model behind ``vllm-mlx serve`` (default mode): a request, the
same request again (served from the stored, wrapped entry) and one with a seed all give mlx-lm's own ``RotatingKVCache(512, keep=4)`` answer. SmolLM2-135M
(float32, OpenBLAS), a ~900-token real-text prompt (the cache wraps). Default mode serves one request at a time (a concurrent one gets 503 from
vllm-mlx itself), so there is no batched route here; the batching mode refuses the option at
start-up (test_vllm_mlx_cli checks the message).
"""

from __future__ import annotations

import pytest
from harness import answer_text, vllm_mlx_serve_cmd
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
