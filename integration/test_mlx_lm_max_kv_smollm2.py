"""``--max-kv-size`` on a real model: one answer whatever route mlx-lm's server takes.

SmolLM2-135M-Instruct (float32, OpenBLAS) behind a real ``mlx_lm.server`` with
``KVPLUGIN_MAX_KV_SIZE=512`` and a real-text prompt of ~900 tokens, so the cache wraps. Two
concurrent requests without a seed (mlx-lm's batched route when batchable), the same request
with a seed (its sequential route), and mlx-lm's own ``generate_step`` with
``RotatingKVCache(512, keep=4)`` in this process (same prefill step as the server's default)
must give the same greedy answer. mlx-lm's own batch cache (``BatchRotatingKVCache``) keeps no
first tokens and answers differently; kvplugin batches such rows in its
``KeepingBatchRotatingKVCache``. The two concurrent requests are streamed to show they were
served in one batch (each one's first token arrives before the other's last).
"""

from __future__ import annotations

import harness
import pytest
from harness import answer_text

from kvplugin.tools import blas
from kvplugin.tools.models import realtext
from kvplugin.tools.models.smollm2 import build_smollm2

pytestmark = pytest.mark.real_model

N = 512
MAX_TOKENS = 24
PREFILL_STEP = 2048  # mlx_lm.server's default --prefill-step-size
TEXT = " ".join(realtext.text("declaration-of-independence").split()[:650])
MESSAGES = [{"role": "user", "content": TEXT + "\n\nIn one sentence, what does this declare?"}]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return build_smollm2(tmp_path_factory.mktemp("smollm2") / "float32")


def _reference(model_dir) -> tuple[int, str]:
    return harness.bounded_reference(model_dir, MESSAGES, N, MAX_TOKENS, PREFILL_STEP)


def test_batched_equals_sequential_equals_mlx_lm(start_server, smollm2_dir):
    n_prompt, reference = _reference(smollm2_dir)
    assert n_prompt > N + 200, n_prompt
    srv = start_server(harness.mlx_lm_server_cmd, model_dir=smollm2_dir,
                       env={**blas.preload_env(), "KVPLUGIN_MAX_KV_SIZE": str(N)})
    a, b = harness.streamed_pair(srv, MESSAGES, MAX_TOKENS)
    sequential = srv.chat(MESSAGES, max_tokens=MAX_TOKENS, seed=3)
    srv.stop()
    assert sequential["usage"]["prompt_tokens"] == n_prompt
    answers = [a, b, answer_text(sequential)]
    assert answers == [reference] * 3, (answers, reference)
