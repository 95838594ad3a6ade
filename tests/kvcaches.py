"""Caches the unit tests fill: real mlx-lm ``KVCache`` layers holding random fp16 K/V."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

H, D = 2, 64  # KV heads and head width of every filled layer


def filled(tokens: int, layers: int = 2) -> list:
    """``layers`` KVCache layers, each holding ``tokens`` tokens of random fp16 K/V."""
    cache = [KVCache() for _ in range(layers)]
    for c in cache:
        k = mx.random.normal((1, H, tokens, D)).astype(mx.float16)
        c.update_and_fetch(k, k)
    mx.eval([c.keys for c in cache])
    return cache


def stored_after_insert(service, entry: list, tokens: int) -> list:
    """Insert ``entry`` for prompt ``range(tokens)`` into a ``KVService`` and return the
    layers its store holds: what a hit would restore from, codec choices included."""
    prompt = list(range(tokens))
    assert service.insert("m", prompt, entry)
    return service.store._index.get("m", tuple(prompt)).cache
