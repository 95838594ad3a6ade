"""``kvplugin bench --server --memory`` end to end on real servers (tiny model, short run):
the in-process recorder traces both processes and the comparison is written for both.
No timing or memory ratio is asserted (those are the benchmark's job); only that every
figure was measured, and that kvplugin reused as many prompt tokens as stock."""

from __future__ import annotations

import json

import pytest

from kvplugin.tools.bench import memory

# kvplugin's own tooling, not a host seam: tox runs it on the newest tested host version only
pytestmark = pytest.mark.tooling


def test_memory_bench_measures_stock_and_kvplugin(tiny_model, tmp_path):
    rc = memory.main(["--model", str(tiny_model), "--configs", "stock,fp16,4bit",
                      "--prompt-tokens", "300", "--turns", "3", "--max-tokens", "4",
                      "--out", str(tmp_path)])
    assert rc == 0
    (out,) = tmp_path.glob("server_memory_*.json")
    data = json.loads(out.read_text())
    assert set(data) == {"stock", "fp16", "4bit"}
    # each row names what produced it: the quantized one its resolved codec
    assert [data[k]["summary"]["server"] for k in data] == [
        "stock", "kvplugin fp16", "kvplugin 4-bit (rotated-channel-k4v4-s4r16)"]
    for key, run in data.items():
        s = run["summary"]
        assert s["entry_mib"] > 0 and s["held_after_mib"] >= 0, (key, s)
        assert s["hwm_growth_x"] is not None and s["max_reuse_transient_x"] is not None
        assert len(run["turns"]) == 3 and all(t["ttft_s"] > 0 for t in run["turns"])
    for key in ("fp16", "4bit"):
        assert data[key]["summary"]["tokens_reused"] >= data["stock"]["summary"]["tokens_reused"] > 0


def test_the_trace_marks_a_spill_to_the_ssd_tier_after_its_eviction(tiny_model, tmp_path):
    """One entry kept in memory (mlx-lm's own --prompt-cache-size 1) and an SSD tier: the
    conversation's first entry evicts the warm-up request's, which goes to disk; the traced
    real server marks both moments, in that order, with the memory read at each."""
    run = memory.run_one(tiny_model, memory.CONFIGS["fp16"], "fp16", "word " * 200, turns=2,
                         max_tokens=4, prefill_step=256, workdir=tmp_path,
                         host_args=["--ssd-cache-dir", str(tmp_path / "ssd"),
                                    "--prompt-cache-size", "1"])
    events = [e for e in run.trace if e["kind"] == "event"]
    names = [e["name"] for e in events]
    assert "spill" in names, names
    spill = names.index("spill")
    assert names[spill - 1] == "evict" and events[spill]["tokens"] == events[spill - 1]["tokens"]
    assert events[spill]["hwm"] > 0 and events[spill]["nbytes"] > 0
    assert any((tmp_path / "ssd").rglob("*.safetensors"))


def test_a_4_bit_store_on_the_sequential_path_stays_under_stock_s_peak(tiny_model, tmp_path):
    """mlx-lm's sequential path (a request with a seed), the 2-layer model, a 1,500-token
    conversation: each layer is half the entry, so a 4-bit store encoded a layer at once
    held 3.2x the entry in MLX (the process peak rose above stock's, and its high-water mark
    ~2.8 MiB above). The real servers' MLX byte counts: the store's codec pass holds under
    one entry, and the whole process's MLX peak is at most stock's."""
    from kvplugin.tools.prompts import TextMaker

    system = TextMaker(tiny_model).text(1500, seed="memory-bench")
    runs = {key: memory.run_one(tiny_model, memory.CONFIGS[key], key, system, turns=3,
                                max_tokens=8, prefill_step=256, workdir=tmp_path, seed=0)
            for key in ("stock", "4bit")}
    # the row names what its entries' layers were stored with (plain layers: no window rule)
    assert runs["4bit"].label == "kvplugin 4-bit (rotated-channel-k4v4-s4r16)", runs["4bit"].label
    events = [e for e in runs["4bit"].trace if e["kind"] == "event"]
    stores = [i for i, e in enumerate(events) if e["name"] == "quantize"]
    assert len(stores) >= 3, [e["name"] for e in events]
    entry = runs["4bit"].entry_bytes
    for i in stores:
        trim = max(j for j in range(i) if events[j]["name"] == "trim")
        window = [x for x in runs["4bit"].trace if events[trim]["t"] < x["t"] <= events[i]["t"]]
        peak = max(x["peak"] for x in window)
        assert peak - events[trim]["active"] < entry, (i, (peak - events[trim]["active"]) / entry)
    peaks = {key: run.summary()["mlx_peak_mib"] for key, run in runs.items()}
    assert peaks["4bit"] <= peaks["stock"], peaks
