"""``KeepingBatchRotatingKVCache``: a batch row answers like ``RotatingKVCache(n, keep=4)``.

Every check runs a small llama twice on the same tokens, teacher-forced: each row alone with
mlx-lm's own ``RotatingKVCache(N, keep=4)`` (what ``mlx_lm.generate --max-kv-size`` and the
sequential path use), and all rows together, left-padded, in the batch cache. The logits
must agree to float32 rounding at every step, through chunked prefill, the bound being passed,
the ring rotating, rows shorter than ``keep``, and the batch bookkeeping mlx-lm's batched path
uses (merge of stored rows, extend, filter, extract).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from kvplugin.cache.bounded.keep_batch import KeepingBatchRotatingKVCache
from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache

N, KEEP = 64, 4
TOL = 1e-3  # float32 rounding (sums in another order); a lost sink moves logits by ~10


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=256, num_key_value_heads=2)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def _tokens(rng, n):
    return [int(x) for x in rng.integers(0, 256, n)]


def _feed(model, cache, tokens, chunk):
    """Prefill ``tokens`` in chunks; the last position's logits."""
    while tokens:
        logits = model(mx.array([tokens[:chunk]]), cache=cache)
        tokens = tokens[chunk:]
    return logits[0, -1]


def _sequential(model, prompt, decode, chunk, cache=None):
    cache = cache if cache is not None else [RotatingKVCache(N, keep=KEEP) for _ in model.layers]
    out = [_feed(model, cache, list(prompt), chunk)]
    for t in decode:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return mx.stack(out), cache


def _batched_prefill(model, cache, prompts, chunk):
    width = max(len(p) for p in prompts)
    toks = mx.array([[0] * (width - len(p)) + list(p) for p in prompts])
    while toks.shape[1]:
        logits = model(toks[:, :chunk], cache=cache)
        toks = toks[:, chunk:]
        mx.eval([c.state for c in cache])
    return logits[:, -1]


def _batched_decode(model, cache, decodes):
    out = []
    for step in range(len(decodes[0])):
        out.append(model(mx.array([[d[step]] for d in decodes]), cache=cache)[:, -1])
        mx.eval([c.state for c in cache])
    return out


def _batched(model, prompts, decodes, chunk, cls=KeepingBatchRotatingKVCache):
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    cache = [cls(N, pad, KEEP) for _ in model.layers]
    for layer in cache:  # what merging the sequential path's rows records (the host's way)
        layer.row_class = PreallocatedRotatingKVCache
    out = [_batched_prefill(model, cache, prompts, chunk)]
    out += _batched_decode(model, cache, decodes)
    return mx.stack(out, axis=1), cache


def _max_err(a, b) -> float:
    return float(mx.max(mx.abs(a - b)))


@pytest.mark.parametrize("lens, chunk, steps", [
    ((10, 30), 16, 10),  # never reaches the bound: the stock ring alone
    ((50, 90), 32, 80),  # one row past the bound in prefill, both while decoding
    ((150, 37), 40, 100),  # prefill chunks longer than the ring's free room
    ((3, 200), 64, 70),  # a row shorter than `keep` beside a long one
    ((200, 201), 512, 30),  # one chunk far past the bound
])
def test_every_row_answers_like_a_rotating_cache_that_keeps_4(model, lens, chunk, steps):
    rng = np.random.default_rng(sum(lens))
    prompts = [_tokens(rng, n) for n in lens]
    decodes = [_tokens(rng, steps) for _ in lens]
    batched, cache = _batched(model, prompts, decodes, chunk)
    for i, (p, d) in enumerate(zip(prompts, decodes)):
        alone, _ = _sequential(model, p, d, chunk)
        assert _max_err(alone, batched[i]) < TOL, (i, lens, chunk)
    past = max(lens) + steps > N
    assert cache[0].sinks_on is past  # nothing extra is done until a row passes the bound


def test_mlx_lms_own_batch_cache_would_answer_differently(model):
    """The check above has teeth: the stock batch cache (keeps no first tokens) fails it."""
    rng = np.random.default_rng(1)
    prompts = [_tokens(rng, 50), _tokens(rng, 90)]
    decodes = [_tokens(rng, 40) for _ in prompts]
    stock, _ = _batched(model, prompts, decodes, 32,
                        cls=lambda n, pad, keep: BatchRotatingKVCache(n, pad))
    alone, _ = _sequential(model, prompts[1], decodes[1], 32)
    assert _max_err(alone, stock[1]) > 100 * TOL


def test_rows_extracted_merged_extended_and_filtered_keep_answering_alike(model):
    """mlx-lm's batched path: stored rows merge back in, a new batch joins (extend), a
    finished row leaves (filter), rows are stored (extract) and continue alone."""
    rng = np.random.default_rng(2)
    chunk = 32
    prompts = [_tokens(rng, 120), _tokens(rng, 20)]
    first = [_tokens(rng, 30) for _ in prompts]
    more = [_tokens(rng, 12), _tokens(rng, 70)]
    then = [_tokens(rng, 25) for _ in prompts]
    # reference: each conversation alone, all turns in one RotatingKVCache(N, 4)
    refs = []
    for p, f, m, t in zip(prompts, first, more, then):
        _, c = _sequential(model, p, f, chunk)
        refs.append(_sequential(model, m, t, chunk, cache=c)[0])
    # turn 1 batched, rows stored as the sequential path's class
    _, cache = _batched(model, prompts, first, chunk)
    stored = [[layer.extract(i) for layer in cache] for i in range(2)]
    assert all(isinstance(c, PreallocatedRotatingKVCache) and c.keep == KEEP
               for row in stored for c in row)
    # turn 2: row 0 resumes from its stored entry (merge), row 1 joins it (extend)
    batch = [PreallocatedRotatingKVCache.merge([stored[0][j]]) for j in range(len(cache))]
    assert all(isinstance(c, KeepingBatchRotatingKVCache) for c in batch)
    joining = [PreallocatedRotatingKVCache.merge([stored[1][j]]) for j in range(len(cache))]
    out0 = [_batched_prefill(model, batch, [more[0]], chunk)[0]]
    out1 = [_batched_prefill(model, joining, [more[1]], chunk)[0]]
    for a, b in zip(batch, joining):
        a.extend(b)
    steps = _batched_decode(model, batch, then)
    out0 += [s[0] for s in steps]
    out1 += [s[1] for s in steps]
    assert _max_err(refs[0], mx.stack(out0)) < TOL
    assert _max_err(refs[1], mx.stack(out1)) < TOL
    # row 0 leaves; row 1 goes on batched, then alone from its extracted entry
    for c in batch:
        c.filter([1])
    tail = _tokens(rng, 20)
    ref_tail = []
    _, c = _sequential(model, prompts[1], first[1], chunk)
    _, c = _sequential(model, more[1], then[1], chunk, cache=c)
    ref_tail = [model(mx.array([[t]]), cache=c)[0, -1] for t in tail]
    got = [s[0] for s in _batched_decode(model, batch, [tail[:10]])]
    alone = [layer.extract(0) for layer in batch]
    got += [model(mx.array([[t]]), cache=alone)[0, -1] for t in tail[10:]]
    assert _max_err(mx.stack(ref_tail), mx.stack(got)) < TOL
