"""The transients a real server showed around the store, pinned in bytes (deterministic).

Each test names the move that removed one transient measured with
``kvplugin bench --server --memory``: a shared prefix served as views of its donor, and
trim / quantize / dequantize that release each layer as they go (``consume=True``).
"""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvplugin.cache.codec.lanes import lane_count
from kvplugin.cache.layers import entry_nbytes
from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
from kvplugin.cache.store.prompt_store import PromptStore
from kvplugin.cache.layers.trim import trim_entry

LAYERS, HEADS, DIM = 8, 2, 64


def entry(n: int, slack: int = 0, layers: int = LAYERS) -> list:
    out = []
    for i in range(layers):
        c = KVCache()
        k = mx.random.normal((1, HEADS, n + slack, DIM), key=mx.random.key(i))
        c.keys, c.values, c.offset = k, k + 1, n
        out.append(c)
    mx.eval([x for c in out for x in (c.keys, c.values)])
    return out


def settle() -> int:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def test_shared_prefix_is_served_as_views_of_the_stored_donor():
    store = PromptStore(max_bytes=1 << 40)
    donor_tokens = list(range(1000))
    store.insert("m", donor_tokens, entry(1000))
    base = settle()
    cache, n = store.fetch("m", list(range(900)) + [-1, -2])  # diverges at 900
    assert n == 900 and store.stats().copied == 1 and len(store) == 1
    mx.eval([x for c in cache for x in (c.keys, c.values)])
    assert mx.get_peak_memory() - base < 4096  # no copy of 900 tokens x 8 layers


def test_consuming_trim_frees_layer_by_layer():
    cache = entry(1000, slack=1000)  # half the buffer is unused slots
    held = entry_nbytes(cache)
    base = settle()
    out = trim_entry(cache, consume=True)
    assert out is cache and all(c.keys.shape[2] == 1000 for c in out)
    peak_over = mx.get_peak_memory() - base
    assert peak_over <= held / LAYERS * 0.5 + 4096  # one trimmed layer at a time, never the entry
    assert mx.get_active_memory() - base <= -held // 2 + 4096  # the slack is gone


def test_consuming_quantize_and_dequantize_free_layer_by_layer():
    """At most ``lane_count()`` layers are in flight (two on a multi-core CPU: both are
    worked on at once, kvplugin.cache.codec.lanes), whatever the number of layers."""
    layers = 4 * LAYERS
    cache = entry(1024, layers=layers)
    fp = entry_nbytes(cache)
    lanes = lane_count()
    base = settle()
    res = quantize_entry(cache, bits=8, group_size=64, consume=True)
    assert res.cache is cache and res.quantized == layers
    # the quantized layers in flight, nothing of the rest
    assert mx.get_peak_memory() - base <= lanes * fp / layers * 0.3 + 4096
    quantized = entry_nbytes(cache)
    base = settle()  # holds the quantized entry
    back = dequantize_entry(cache, consume=True)
    assert back is cache and all(type(c) is KVCache for c in back)
    # The whole fp entry comes back while the quantized layers go: the peak is the fp entry
    # plus the layers in flight (and their temporaries), never fp + the quantized entry.
    peak = mx.get_peak_memory() - (base - quantized)
    assert peak <= fp + lanes * 1.3 * fp / layers < fp + quantized
