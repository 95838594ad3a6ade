"""A chunked-attention entry (Llama 4) cut to a prefix continues exactly as a fresh prefill.

Why: ``ChunkedKVCache.maybe_trim_front`` keeps the newest ``chunk_size`` tokens, not whole
chunks, so a stored entry may have lost the start of the chunk a cut lands in. A cut there
answered differently from stock; it is now refused (another entry or a shorter cut serves).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ChunkedKVCache, make_prompt_cache

from kvplugin.cache.store.index import PrefixTrie, choose
from kvplugin.cache.layers import can_copy_prefix, copy_floor, copy_prefix
from kvplugin.tools.models.families import build_family_model

pytestmark = pytest.mark.host_version("mlx-lm", ">=0.32.0")  # llama4 exists from 0.32.0 on

CHUNK = 128


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    from mlx_lm.utils import load_model

    model, _ = load_model(build_family_model("llama4", tmp_path_factory.mktemp("l4") / "m"))
    return model


def _run(model, cache, tokens, step=64):
    """Prefill ``tokens`` into ``cache`` in steps (as a server does); the last logits."""
    out = None
    for i in range(0, len(tokens), step):
        out = model(mx.array(tokens[i:i + step])[None], cache=cache)[:, -1, :]
        mx.eval(out)
    return out


def test_cut_inside_a_front_trimmed_chunk_is_refused_and_others_are_exact(llama4):
    tokens = [(7 * i + 3) % 250 + 1 for i in range(560)]
    stored = make_prompt_cache(llama4)
    _run(llama4, stored, tokens[:520], step=128)
    for t in tokens[520:560]:  # decode one token at a time: the front is trimmed each step
        _run(llama4, stored, [t])
    start = stored[0].start_position
    assert isinstance(stored[0], ChunkedKVCache) and start % CHUNK != 0, start
    floor = copy_floor(stored)
    assert floor == -(-start // CHUNK) * CHUNK
    follow = tokens[100:130]
    for n in (start - 1, start + 1, floor - 1, floor, floor + 5, 559):
        if n < start:
            assert not can_copy_prefix(stored, n)
            continue
        fresh = make_prompt_cache(llama4)
        _run(llama4, fresh, tokens[:n])
        want = _run(llama4, fresh, follow)
        if n < floor:  # the naive cut (what was served before): it lost its chunk's start
            assert not can_copy_prefix(stored, n) and copy_prefix(stored, n) is None
            naive = [copy_prefix([layer], n)[0] if not isinstance(layer, ChunkedKVCache)
                     else _naive_cut(layer, n) for layer in stored]
            got = _run(llama4, naive, follow)
            assert not mx.allclose(got, want, atol=1e-4).item(), n  # it really was wrong
            continue
        cut = copy_prefix(stored, n)
        assert cut is not None, n
        got = _run(llama4, cut, follow)
        assert mx.allclose(got, want, atol=1e-5).item(), n


def _naive_cut(layer, n):
    new = ChunkedKVCache(layer.chunk_size)
    m = n - layer.start_position
    new.keys, new.values = layer.keys[..., :m, :], layer.values[..., :m, :]
    new.offset, new.start_position = n, layer.start_position
    return new


class _Entry:
    def __init__(self, tokens, floor):
        self.tokens, self.floor = tokens, floor


def test_choose_falls_back_to_an_entry_that_can_give_the_cut():
    """The longest entry below the divergence cannot be cut there: a shorter turn of the same
    conversation that diverges earlier still serves its shared tokens (stock would have cut
    the longer one inexactly)."""
    trie = PrefixTrie()
    turn1 = _Entry(tuple(range(1, 440)) + (900,), floor=1)
    turn2 = _Entry(tuple(range(1, 500)) + (901,), floor=512)
    for e in (turn1, turn2):
        trie.insert(e.tokens, e)
    request = tuple(range(1, 480)) + (5, 6)
    got = choose(trie, request, trimmable=lambda e: True,
                 copyable=lambda e, n: n >= e.floor)
    assert got == ("copy", turn1, 439)
