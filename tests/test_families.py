"""The tiny family models build offline, reproducibly, and load as their mlx-lm class."""

from __future__ import annotations

import hashlib

import pytest
import mlx_lm
from mlx_lm import generate
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, KVCache,
                                 RotatingKVCache, make_prompt_cache)
from mlx_lm.utils import load

from kvplugin.tools.models.families import FAMILIES, available, build_family_model

# the layer classes each family's cache is made of (in layer order)
EXPECTED_CACHE = {
    "mamba": [ArraysCache] * 2,
    "deepseek_v3": [KVCache] * 2,
    "gemma3_text": [RotatingKVCache, RotatingKVCache, KVCache],
    "gpt_oss": [RotatingKVCache, KVCache],
    "qwen3_next": [ArraysCache] * 3 + [KVCache],
    "falcon_h1": [CacheList] * 2,
    "llama4": [ChunkedKVCache] * 3 + [KVCache],
}
HERE = [f for f in sorted(FAMILIES) if available(f, mlx_lm.__version__)]


@pytest.mark.parametrize("family", HERE)
def test_family_builds_reproducibly_and_loads(family, tmp_path):
    a = build_family_model(family, tmp_path / "a")
    b = build_family_model(family, tmp_path / "b")
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (a, b)]
    assert digest[0] == digest[1]
    model, tokenizer = load(str(a))
    assert model.model_type == family
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == EXPECTED_CACHE[family]
    # a ~1k-token prompt: longer than the sliding windows / chunks (128), so they wrap
    text = generate(model, tokenizer, "the river and the hills " * 100, max_tokens=4,
                    prompt_cache=cache)
    assert text
    for c in cache:  # the windows (128) wrapped: the layer holds fewer tokens than it saw
        if isinstance(c, RotatingKVCache):
            assert c.offset > c.max_size == 128 and c.keys.shape[2] == 128
        if isinstance(c, ChunkedKVCache):
            assert c.offset > 128 and c.start_position > 0
