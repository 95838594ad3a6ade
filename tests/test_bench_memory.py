"""``kvplugin bench --server --memory``: where the prompt tokens reused come from.

Why: vllm-mlx's chat completions carry no ``usage.prompt_tokens_details.cached_tokens``, so
summing usage said "0 reused" for stock and kvplugin alike on ``--continuous-batching``,
although both reuse; the host's own prefix-cache count (``/v1/status``) is read instead.
"""

from __future__ import annotations

from typing import Any

import mlx_lm
import pytest

from kvplugin.tools.bench.memory import (
    RunResult,
    TurnResult,
    configs_to_run,
    entry_bytes,
    host_tokens_saved,
    results_json,
    table,
)
from kvplugin.tools.models.families import available, build_family_model


def turn(cached: int | None, text: str = "x", start: float = 0.0) -> TurnResult:
    return TurnResult(start=start, end=start + 1.0, prompt_tokens=10, cached_tokens=cached,
                      ttft_s=0.1, decode_tok_s=None, text=text)


def traced(key: str, texts: list[str], cached: list[int]) -> RunResult:
    """A run with a two-sample trace, enough for ``summary()``."""
    r = RunResult(key, key, 1 << 20, turns=[turn(c, t, float(i)) for i, (t, c)
                                          in enumerate(zip(texts, cached))])
    r.trace = [{"t": -1.0, "kind": "sample", "hwm": 0, "active": 0, "peak": 0},
               {"t": 9.0, "kind": "sample", "hwm": 2 << 20, "active": 1 << 20, "peak": 1 << 20}]
    return r


def test_the_table_says_whose_answers_were_stocks_and_reuse_of_how_many_tokens():
    """A quantized entry may change an answer; every later prompt then differs, so a lower
    reuse count there is not lost reuse. The table says which rows that happened to."""
    stock = traced("stock", ["a", "b", "c"], [0, 8, 9])
    same = traced("fp16", ["a", "b", "c"], [0, 8, 9])
    changed = traced("4bit", ["a", "B", "c"], [0, 8, 8])
    text = table([stock, same, changed], "t")
    rows = {line.split()[0]: line.split()[-4:] for line in text.splitlines() if line.strip()}
    assert rows["fp16"] == ["17", "of", "30", "3/3"]
    assert rows["4bit"] == ["16", "of", "30", "2/3"]
    assert rows["stock"] == ["17", "of", "30", "-"]
    assert text.splitlines()[-1].startswith("4bit: an answer differed from stock's")
    assert "differed" not in table([stock, same], "t")
    assert results_json([stock, changed])["4bit"]["summary"]["answers_as_stock"] == 2


def test_usage_wins_when_the_host_reports_it():
    r = RunResult("k", "k", 1, turns=[turn(0), turn(5), turn(None)], host_tokens_saved=99)
    assert r.tokens_reused() == 5


def test_without_usage_the_hosts_own_count_is_used_and_unknown_is_not_zero():
    assert RunResult("k", "k", 1, turns=[turn(None)] * 3, host_tokens_saved=42).tokens_reused() == 42
    assert RunResult("k", "k", 1, turns=[turn(None)] * 3).tokens_reused() is None


class FakeServer:
    def __init__(self, status: int, body: Any) -> None:
        self.answer = (status, body)

    def request(self, method: str, path: str, timeout: float | None = None) -> tuple[int, Any]:
        assert (method, path) == ("GET", "/v1/status")
        return self.answer


def test_host_tokens_saved_reads_v1_status():
    assert host_tokens_saved(FakeServer(200, {"cache": {"tokens_saved": 5481}})) == 5481
    assert host_tokens_saved(FakeServer(200, {"cache": None})) is None
    assert host_tokens_saved(FakeServer(404, "not found")) is None


def test_stock_always_runs_first_so_every_row_has_its_baseline():
    assert configs_to_run("4bit,8bit") == ["stock", "4bit", "8bit"]
    assert configs_to_run("fp16,stock,fp16") == ["stock", "fp16"]
    with pytest.raises(ValueError, match="unknown --configs 2bit"):
        configs_to_run("stock,2bit")


_ENTRY_FAMILIES = [f for f in ("mamba", "gemma3_text", "deepseek_v3", "falcon_h1")
                   if available(f, mlx_lm.__version__)]


@pytest.mark.parametrize("family", _ENTRY_FAMILIES)
def test_the_entry_is_what_the_models_own_cache_holds(family, tmp_path):
    """The bench's "x entry" unit is read from the model's cache classes. It was computed from
    ``config.json`` as plain attention, which crashed on Mamba (no attention heads) after the
    whole run, and was wrong for windows, recurrent state and latent (MLA) caches."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvplugin.cache.layers import entry_nbytes
    from kvplugin.cache.layers.trim import trim_entry

    model_dir = build_family_model(family, tmp_path / family)
    model, _ = load(str(model_dir))
    n = 300  # past the tiny models' 128-token windows
    cache = make_prompt_cache(model)
    ids = mx.array([[5 + i % 50 for i in range(n)]])
    for start in range(0, n, 64):  # in prefill steps, as a server feeds a prompt
        model(ids[:, start : start + 64], cache=cache)
    assert entry_bytes(model_dir, n) == entry_nbytes(trim_entry(cache)) > 0
    if family == "mamba":  # recurrent state only: the same at any length
        assert entry_bytes(model_dir, 10) == entry_bytes(model_dir, n)
