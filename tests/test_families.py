"""The tiny family models build offline, reproducibly, and load as their mlx-lm class."""

from __future__ import annotations

import hashlib

import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.utils import load

from kvplugin.tools.models.families import FAMILIES, build_family_model

EXPECTED_CACHE = {"mamba": ArraysCache, "deepseek_v3": KVCache}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_builds_reproducibly_and_loads(family, tmp_path):
    a = build_family_model(family, tmp_path / "a")
    b = build_family_model(family, tmp_path / "b")
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (a, b)]
    assert digest[0] == digest[1]
    model, tokenizer = load(str(a))
    assert model.model_type == family
    cache = make_prompt_cache(model)
    assert cache and all(type(c) is EXPECTED_CACHE[family] for c in cache)
    assert tokenizer.encode("the river")
