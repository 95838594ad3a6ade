"""``kvplugin bench --bound --batched``: decode of a batch past its ``--max-kv-size`` bound.

Two requests of real text (SmolLM2-135M-Instruct, float32; the same length, so no padding)
prefilled past the bound, then decoded together, for three ways to serve them:

- ``stock batch``: mlx-lm's ``BatchRotatingKVCache(bound)``, what its batched path builds
  (keeps no first tokens, so its answers differ from the two below: a speed reference only);
- ``kvplugin batch``: ``KeepingBatchRotatingKVCache(bound, keep=4)``, what kvplugin's
  batched paths build (the answers of ``RotatingKVCache(bound, keep=4)``);
- ``one at a time``: each request alone in ``RotatingKVCache(bound, keep=4)``, how kvplugin
  served bounded models on mlx-lm before it had a batch cache that keeps first tokens.

Reported: decode tokens/s over all rows (median and range over rounds; the three take turns
within a round). Numbers, not a test: nothing here is asserted.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

VARIANTS = ("stock batch", "kvplugin batch", "one at a time")


def _timed_decode(model: Any, cache: list, rows: int, steps: int) -> float:
    import mlx.core as mx

    y = mx.ones((rows, 1), dtype=mx.int32)
    start = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y, [c.state for c in cache])
    return time.perf_counter() - start


def _prefilled(model: Any, prompts: list[list[int]], cache: list) -> list:
    import mlx.core as mx

    x = mx.array(prompts)
    for i in range(0, x.shape[1], 2048):
        model(x[:, i: i + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def decode_seconds(variant: str, model: Any, prompts: list[list[int]], bound: int,
                   steps: int) -> float:
    """Seconds to decode ``steps`` tokens for every prompt, served as ``variant`` says."""
    from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

    from kvplugin.cache.bounded.keep_batch import KeepingBatchRotatingKVCache

    n, pad = len(model.layers), [0] * len(prompts)
    if variant == "one at a time":
        return sum(_timed_decode(model, _prefilled(model, [p], [RotatingKVCache(bound, keep=4)
                                                                for _ in range(n)]), 1, steps)
                   for p in prompts)
    make = ((lambda: BatchRotatingKVCache(bound, pad)) if variant == "stock batch"
            else (lambda: KeepingBatchRotatingKVCache(bound, pad, 4)))
    return _timed_decode(model, _prefilled(model, prompts, [make() for _ in range(n)]),
                         len(prompts), steps)


def run(bound: int, steps: int, rounds: int, prompt_words: int = 650) -> dict[str, Any]:
    from mlx_lm import load

    from kvplugin.tools.models import realtext
    from kvplugin.tools.models.smollm2 import build_smollm2

    model, tok = load(str(build_smollm2()))
    words = realtext.text("declaration-of-independence").split()
    prompts = [tok.encode(" ".join(words[:prompt_words])),
               tok.encode(" ".join(words[100: 100 + prompt_words]))]
    length = min(len(p) for p in prompts)
    prompts = [p[:length] for p in prompts]
    tps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS[r % 3:] + VARIANTS[: r % 3]:
            tps[v].append(len(prompts) * steps / decode_seconds(v, model, prompts, bound, steps))
    return {"prompt_tokens": length, "rows": len(prompts), "bound": bound, "steps": steps,
            "rounds": rounds,
            "tokens_per_s": {v: {"median": statistics.median(x), "min": min(x), "max": max(x)}
                             for v, x in tps.items()}}


def table(result: dict[str, Any]) -> str:
    tps = result["tokens_per_s"]
    base = tps["stock batch"]["median"]
    lines = [f"{result['rows']} requests x {result['prompt_tokens']} prompt tokens, bound "
             f"{result['bound']}, {result['steps']} decode steps, {result['rounds']} rounds",
             "", "| served as | decode tok/s (all rows, median) | range | vs stock batch |",
             "|---|---|---|---|"]
    for v in VARIANTS:
        t = tps[v]
        lines.append(f"| {v} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | "
                     f"{t['median'] / base:.2f}x |")
    return "\n".join(lines)
