"""The zero-copy batch-of-one merge against mlx-lm's own ``BatchKVCache`` (no host server).

Why these tests: the adopted batch must be indistinguishable from mlx-lm's own merge (same
content, shapes and bookkeeping, so attention and later growth behave the same) while
allocating nothing; anything but a single plain ``KVCache`` must take mlx-lm's path.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from kvplugin.hosts.mlx_lm.batch import adopting_merge

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
    from kvplugin.hosts.mlx_lm.batch import _adoptable

    assert not _adoptable(r, KVCache)
    assert _adoptable(filled(3), KVCache)


# -- the split's filter and the final extract (mlx-lm >= 0.31's BatchGenerator) ------------

import copy  # noqa: E402

from kvplugin.hosts.mlx_lm.batch import adopting_extract, whole_batch_filter  # noqa: E402

FILTER = whole_batch_filter(vars(BatchKVCache)["filter"])
EXTRACT = adopting_extract(vars(BatchKVCache)["extract"], KVCache)
ORIGINAL_FILTER = vars(BatchKVCache)["filter"]
ORIGINAL_EXTRACT = vars(BatchKVCache)["extract"]


def batch_of_one(n: int) -> BatchKVCache:
    """A generation batch of one as mlx-lm leaves it: step slack after ``n`` tokens."""
    b = BatchKVCache([0])
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(7))
    b.update_and_fetch(k, k * 3)
    mx.eval(b.keys, b.values, b.offset, b.left_padding)
    return b


def test_keeping_every_row_is_a_view_with_the_same_content():
    ours, stock = batch_of_one(300), batch_of_one(300)
    FILTER(ours, [0])
    ORIGINAL_FILTER(stock, [0])
    assert ours._idx == stock._idx
    assert mx.array_equal(ours.keys, stock.keys) and mx.array_equal(ours.values, stock.values)
    assert ours.offset.tolist() == stock.offset.tolist()


def test_a_real_selection_still_gathers():
    b = BatchKVCache.merge([filled(5), filled(9)])
    want = BatchKVCache.merge([filled(5), filled(9)])
    FILTER(b, [1])
    ORIGINAL_FILTER(want, [1])
    assert mx.array_equal(b.keys, want.keys) and b.offset.tolist() == want.offset.tolist()


@pytest.mark.parametrize("padding", [0, 3])
def test_extract_hands_out_the_batch_buffer_with_the_same_state(padding):
    def make():
        b = BatchKVCache([padding])
        k = mx.random.normal((1, 2, 40, 8), key=mx.random.key(3))
        b.update_and_fetch(k, k + 1)
        return b

    b = make()
    ours, stock = EXTRACT(b, 0), ORIGINAL_EXTRACT(make(), 0)
    assert type(ours) is KVCache and ours.offset == stock.offset == 40 - padding
    n = ours.offset  # .state differs across mlx-lm versions (0.32 adds the offset)
    assert mx.array_equal(ours.keys[..., :n, :], stock.keys[..., :n, :])
    assert mx.array_equal(ours.values[..., :n, :], stock.values[..., :n, :])
    if padding == 0:
        assert ours.keys is b.keys  # adopted, not copied


def test_extract_of_several_rows_takes_mlx_lms_path():
    b = BatchKVCache.merge([filled(5), filled(9)])
    got = EXTRACT(b, 1)
    want = ORIGINAL_EXTRACT(BatchKVCache.merge([filled(5), filled(9)]), 1)
    assert got.offset == want.offset and mx.array_equal(got.state[0], want.state[0])


def _stage_peaks(merge, filter_, extract) -> tuple[list[float], list]:
    """MLX peak of each whole-cache step of one reuse by a batch of one, x the entry.

    The cache-level steps of mlx-lm's ``BatchGenerator`` for one request, as vllm-mlx's
    ``--continuous-batching`` drives them: merge the fetched entry (here a view of a stored
    donor, as a shared prefix is served), grow by the new turn's tokens, split into a
    generation batch (``_copy``'s deepcopy, then ``filter([0])``), extract at the end while
    the batch is dropped. Growth itself is not measured: it is a new buffer either way.
    """
    n = 2000
    donor = filled(n, step_slack=False)
    entry = KVCache()
    entry.keys, entry.values, entry.offset = donor.keys[..., :n, :], donor.values[..., :n, :], n
    nbytes = donor.keys.nbytes + donor.values.nbytes
    peaks: list[float] = []
    base = 0

    def start() -> None:
        nonlocal base
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()

    def stage(arrays: list) -> None:
        mx.eval(arrays)
        mx.synchronize()
        peaks.append((mx.get_peak_memory() - base) / nbytes)

    start()
    batch = [merge([entry])]
    del entry
    stage([(c.keys, c.values) for c in batch])
    new = mx.ones((1, 2, 30, 8))
    for c in batch:
        c.update_and_fetch(new, new)
    mx.eval([(c.keys, c.values) for c in batch])
    start()
    gen = copy.deepcopy(batch)
    batch.clear()
    for c in gen:
        filter_(c, [0])
    stage([(c.keys, c.values) for c in gen])
    start()
    out = [extract(c, 0) for c in gen]
    gen.clear()
    stage([(c.keys, c.values) for c in out])
    # keys/values, not .state: 0.32 adds the offset to it
    return peaks, [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in out]


def test_a_batch_of_one_is_merged_split_and_extracted_without_copies():
    stock, stock_state = _stage_peaks(lambda cs: ORIGINAL(BatchKVCache, cs), ORIGINAL_FILTER,
                                      ORIGINAL_EXTRACT)
    ours, ours_state = _stage_peaks(MERGE, FILTER, EXTRACT)
    for (a, b), (c, d) in zip(ours_state, stock_state):
        assert mx.array_equal(a, c) and mx.array_equal(b, d)
    # The split's gather copies keys and values (MLX may free one's source before the other's
    # copy: >= half the entry at once), the extract's contiguous copy the whole cache. MLX
    # already makes a single exact-size merge free (a full-extent slice update is the update).
    assert stock[1] >= 0.45 and stock[2] >= 0.9, stock
    assert all(p < 0.05 for p in ours), ours  # bookkeeping arrays only


def test_vllm_mlx_batching_installs_and_restores_the_batch_of_one_seams():
    import mlx_lm.models.cache as mlc

    from kvplugin.hosts.base import PatchRegistry
    from kvplugin.hosts.vllm_mlx.batching import install_batch_of_one

    own = {n: vars(BatchKVCache)[n] for n in ("merge", "filter", "extract")}
    patches = PatchRegistry()
    install_batch_of_one(patches, mlc)
    try:
        assert vars(BatchKVCache)["filter"].__kvplugin_original__ is own["filter"]
        assert vars(BatchKVCache)["extract"].__kvplugin_original__ is own["extract"]
        assert vars(BatchKVCache)["merge"].__func__.__kvplugin_original__ is own["merge"].__func__
        b = batch_of_one(20)
        assert b.extract(0).keys is b.keys
    finally:
        patches.restore_all()
    assert all(vars(BatchKVCache)[n] is f for n, f in own.items())
