"""The zero-copy batch-of-one merge against mlx-lm's own ``BatchKVCache`` (no host server).

Why these tests: the adopted batch must be indistinguishable from mlx-lm's own merge (same
content, shapes and bookkeeping, so attention and later growth behave the same) while
allocating nothing; anything but a single plain ``KVCache`` must take mlx-lm's path.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from kvplugin.hosts.mlx_lm_batch import adopting_merge

ORIGINAL = vars(BatchKVCache)["merge"].__func__
MERGE = adopting_merge(ORIGINAL, KVCache).__get__(None, BatchKVCache)


def filled(n: int, step_slack: bool = True) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(n))
    c.update_and_fetch(k, k * 2)
    if not step_slack:  # exact-size buffers, as a trimmed stored entry has
        c.keys, c.values = mx.contiguous(c.keys[..., :n, :]), mx.contiguous(c.values[..., :n, :])
    mx.eval(c.keys, c.values)
    return c


@pytest.mark.parametrize("exact", [True, False])
def test_single_cache_is_adopted_with_the_same_content_and_state(exact):
    n = 37
    cache = filled(n, step_slack=not exact)
    stock = ORIGINAL(BatchKVCache, [filled(n, step_slack=not exact)])
    ours = MERGE([cache])
    assert type(ours) is BatchKVCache
    assert ours._idx == stock._idx == n
    assert ours.offset.tolist() == stock.offset.tolist()
    assert ours.left_padding.tolist() == stock.left_padding.tolist()
    assert mx.array_equal(ours.keys, stock.keys) and mx.array_equal(ours.values, stock.values)
    if exact:
        assert ours.keys is cache.keys and ours.values is cache.values  # adopted, not copied


def test_adoption_allocates_nothing():
    cache = filled(4000, step_slack=False)
    mx.eval(cache.keys)
    before = mx.get_active_memory()
    batch = MERGE([cache])
    mx.eval(batch.keys, batch.values, batch.offset, batch.left_padding)
    entry = cache.keys.nbytes + cache.values.nbytes
    assert mx.get_active_memory() - before < 1024 < entry  # the bookkeeping arrays only


def test_adopted_batch_grows_and_leaves_a_shared_buffer_unchanged():
    cache = filled(10, step_slack=False)
    snapshot = mx.array(cache.keys)
    batch = MERGE([cache])
    new = mx.ones((1, 2, 3, 8))
    k, _ = batch.update_and_fetch(new, new)
    mx.eval(k)
    assert batch._idx == 13 and k.shape[2] == 13
    assert mx.array_equal(k[..., :10, :], snapshot) and mx.array_equal(k[..., 10:, :], new)
    assert mx.array_equal(cache.keys, snapshot)  # whoever else holds the entry sees no change


@pytest.mark.parametrize(
    "caches",
    [
        lambda: [filled(5), filled(9)],  # several requests: mlx-lm pads and copies
        lambda: [KVCache()],  # empty
    ],
)
def test_everything_else_takes_mlx_lms_merge(caches):
    got = MERGE(caches())
    want = ORIGINAL(BatchKVCache, caches())
    assert got._idx == want._idx
    if want.keys is not None:
        assert mx.array_equal(got.keys, want.keys)


def test_rotating_cache_is_not_adopted():
    r = RotatingKVCache(max_size=16)
    k = mx.ones((1, 2, 4, 8))
    r.update_and_fetch(k, k)
    from kvplugin.hosts.mlx_lm_batch import _adoptable

    assert not _adoptable(r, KVCache)
    assert _adoptable(filled(3), KVCache)
