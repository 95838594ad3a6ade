"""Full-precision rows before earlier prompt boundaries: a repeated or edited turn reuses a
*prefix* of a later entry, whose last tokens are then these (the prefix-served answer).

Through the real code paths: ``quantize_entry``/``dequantize_entry``, a prefix copy, the
serialized (SSD and remote) form, and a ``KVService`` that learns the boundaries from its own
fetches and hands them to the ``kvplugin_quantize_entry`` hook.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from test_codecs import N, _layer

from kvplugin.cache.layers import copy_prefix, entry_nbytes
from kvplugin.cache.codec.quantize import BOUNDARY_ATTR, UnknownCodec, dequantize_entry, quantize_entry
from kvplugin.cache.tiers.serialize import deserialize_cache, serialize_cache
from kvplugin.hookspecs import hookimpl

CODEC = dict(bits=4, group_size=64, codec="rotated-channel", sink_tokens=4, recent_tokens=16)


def _exact(a: KVCache, b: KVCache, lo: int, hi: int) -> bool:
    return (mx.array_equal(a.keys[..., lo:hi, :], b.keys[..., lo:hi, :])
            and mx.array_equal(a.values[..., lo:hi, :], b.values[..., lo:hi, :]))


def test_rows_before_each_boundary_come_back_exact():
    src = _layer()
    q = quantize_entry([src], prompt_boundaries=(100, 200), **CODEC).cache[0]
    assert getattr(q, BOUNDARY_ATTR) == "84:16,184:16"
    plain = quantize_entry([_layer()], **CODEC).cache[0]
    assert q.keys[3].shape[-2] == plain.keys[3].shape[-2] + 32  # 32 rows more, no other cost
    back = dequantize_entry([q])[0]
    for lo, hi in ((0, 4), (84, 100), (184, 200), (N - 16, N)):
        assert _exact(back, src, lo, hi), (lo, hi)
    assert not _exact(back, src, 100, 184)  # the rest is quantized
    base = dequantize_entry([plain])[0]
    assert _exact(back, base, 100, 184)  # and quantized the same way as without boundaries


def test_a_prefix_ending_at_a_boundary_keeps_its_last_rows_exact():
    """What the repeated turn gets: the store cuts the entry to the reused length, by a
    trim of the offset or by a prefix copy (which also cuts the full-precision rows)."""
    src = _layer()
    q = quantize_entry([src], prompt_boundaries=(150,), **CODEC).cache
    copied = copy_prefix(q, 149)
    assert copied is not None and copied[0].keys[3].shape[-2] <= 149
    for cut in (copied, q):
        cut[0].offset = 149
        back = dequantize_entry(cut)[0]
        assert back.offset == 149
        assert _exact(back, src, 0, 4) and _exact(back, src, 134, 149)
        assert not _exact(back, src, 100, 134)


@pytest.mark.parametrize("boundaries, want", [
    ((2, 10, 12, N - 5), f"4:8,{N - 21}:5"),  # cut to lie between; overlapping ones merged
    ((N - 20,), f"{N - 36}:16"),               # next to the recent rows: kept apart
    ((3,), None),                              # inside the sinks: nothing more
])
def test_boundary_ranges_are_cut_to_lie_between_sinks_and_recent_rows(boundaries, want):
    src = _layer()
    q = quantize_entry([src], prompt_boundaries=boundaries, **CODEC).cache[0]
    assert getattr(q, BOUNDARY_ATTR, None) == want
    back = dequantize_entry([q])[0]
    assert _exact(back, src, 0, 4) and _exact(back, src, N - 16, N)


def test_boundaries_need_recent_tokens_and_skip_windows():
    q = quantize_entry([_layer()], prompt_boundaries=(100,), bits=8, group_size=64).cache[0]
    assert len(q.keys) == 3 and not hasattr(q, BOUNDARY_ATTR)  # affine 8-bit: none kept


def test_boundary_rows_round_trip_through_the_stored_form():
    src = _layer()
    q = quantize_entry([src], prompt_boundaries=(120,), **CODEC).cache
    back = deserialize_cache(*serialize_cache(q))
    assert getattr(back[0], BOUNDARY_ATTR) == "104:16"
    assert _exact(dequantize_entry(back)[0], src, 104, 120)


@pytest.mark.parametrize("record", ["184:16,84:16", "84:16,90:16", "84", "x:16", "84:0",
                                    f"{N - 10}:16", 7])
def test_a_damaged_boundary_record_is_a_miss_not_misread(record):
    q = quantize_entry([_layer()], prompt_boundaries=(100, 200), **CODEC).cache
    setattr(q[0], BOUNDARY_ATTR, record)
    with pytest.raises(UnknownCodec):
        dequantize_entry(q)


def test_a_boundary_record_without_full_precision_rows_is_a_miss():
    q = quantize_entry([_layer()], bits=4, group_size=64, codec="rotated-channel").cache
    assert len(q[0].keys) == 3
    setattr(q[0], BOUNDARY_ATTR, "84:16")
    with pytest.raises(UnknownCodec):
        dequantize_entry(q)


class _SeesBoundaries:
    """A plugin that only watches (returns None: the built-in still quantizes)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[int, ...]]] = []

    @hookimpl
    def kvplugin_quantize_entry(self, cache, num_tokens, settings, prompt_boundaries):
        self.seen.append((num_tokens, prompt_boundaries))


def test_service_learns_boundaries_from_its_fetches_and_hands_them_to_the_hook():
    from kvplugin import plugins
    from kvplugin.cache.service.service import KVService
    from kvplugin.settings import resolve_settings

    pm = plugins.create_plugin_manager(load_entry_points=False)
    watcher = _SeesBoundaries()
    pm.register(watcher)
    s = KVService(resolve_settings(dict(kv_cache_quantization_bits=4,
                                        kv_cache_min_quantize_tokens=0)),
                  host="test", hook=pm.hook, max_bytes=1 << 40)
    first = list(range(100))
    turn = first + list(range(1000, 1100))  # the first prompt, its answer, a second prompt
    assert s.fetch("m", first) == (None, 0)   # each request's prompt is fetched first
    assert s.fetch("m", turn) == (None, 0)
    assert s.insert("m", turn + list(range(2000, 2100)), [_layer()])  # 300 tokens
    assert watcher.seen == [(300, (100, 200))]
    [entry] = s.store.entries()
    assert getattr(entry.cache[0], BOUNDARY_ATTR) == "84:16,184:16"
    src = _layer()
    cache, n = s.fetch("m", first + [5])  # the first question again: a prefix of the entry
    assert n == 100 and _exact(cache[0], src, 84, 100)
    assert entry_nbytes(entry.cache) < 0.35 * entry_nbytes([src])


def test_recent_prompts_find_the_ends_an_entry_contains():
    from kvplugin.cache.store.prompts import MAX_PROMPT_BOUNDARIES, RecentPrompts

    seen = RecentPrompts(size=16)
    entry = list(range(1000))
    seen.add("m", [])  # nothing to learn from an empty prompt
    for end in range(50, 650, 50):  # 12 turns of one conversation
        seen.add("m", entry[:end])
    seen.add("m", entry[:300] + [7])        # another branch: not a prefix of the entry
    seen.add("m", [5] + entry[1:400])       # same length and last token, other tokens
    seen.add("m", entry)                    # the whole entry: not *inside* it
    assert seen.prompt_len("m", entry) == 600
    assert seen.boundaries("m", entry) == tuple(range(650 - 50 * MAX_PROMPT_BOUNDARIES, 650, 50))
    assert seen.boundaries("m", entry[:120]) == (50, 100)
    assert seen.prompt_len("m", [9, 9]) is None and seen.boundaries("m", []) == ()
    # another model key (another checkpoint, or a request's cache_salt) learns nothing here
    assert seen.prompt_len("m|salt=b", entry) is None and seen.boundaries("m|salt=b", entry) == ()
