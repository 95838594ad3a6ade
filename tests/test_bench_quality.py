"""The quality benchmark's quick run: a seconds-long trained model, report structure, and
the ordering of the bit widths (no timing assertions)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from kvplugin.tools.models import quality as qm  # noqa: E402
from kvplugin.tools.bench import quality  # noqa: E402

# kvplugin's own tooling, not a host seam: tox runs it on the newest tested host version only
pytestmark = pytest.mark.tooling


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("quality")
    out, model_dir = base / "out", base / "model"
    rc = quality.main(["--quick", "--out", str(out), "--model-dir", str(model_dir),
                       "--no-progress", "--no-plots"])
    assert rc == 0
    return json.loads((out / "quality.json").read_text()), model_dir


def test_report_structure(run):
    report, _ = run
    for key in ("config", "model", "environment", "trained", "random_init", "goals",
                "goal_limits", "elapsed_s"):
        assert key in report, key
    rows = report["trained"]["rows"]
    assert {(r["bits"], r["group_size"]) for r in rows} == {
        (b, g) for b in quality.BITS for g in quality.GROUPS}
    for r in rows:
        for k in ("kl_mean", "kl_max", "greedy_agreement", "ppl", "ppl_fp16", "ppl_delta",
                  "free_running_match", "tokens_before_divergence_mean", "stored_bytes",
                  "fp16_bytes", "positions"):
            assert k in r, (k, r)
        assert r["kl_mean"] >= 0
        assert 0.0 <= r["greedy_agreement"] <= 1.0
        assert r["layers_quantized"] == qm.QUICK_SPEC.num_layers and r["layers_skipped"] == 0
        assert r["stored_bytes"] / r["fp16_bytes"] == pytest.approx(
            r["bits"] / 16 + 2 / r["group_size"], rel=1e-9)
    cfg = report["config"]
    assert rows[0]["positions"] == cfg["documents"] * cfg["continuation_tokens"]
    names = {g["name"] for g in report["goals"]}
    assert names == {"8-bit KL divergence vs fp16 KV", "8-bit greedy agreement"}
    ks = report["trained"]["key_stats"]
    assert ks["max_over_median_channel_rms"] >= 1.0


def test_kl_grows_as_bits_shrink(run):
    report, _ = run
    kl = {(r["bits"], r["group_size"]): r["kl_mean"] for r in report["trained"]["rows"]}
    assert kl[(8, 64)] < kl[(4, 64)] < kl[(2, 64)]
    rnd = {(r["bits"], r["group_size"]): r["kl_mean"] for r in report["random_init"]["rows"]}
    assert rnd[(8, 64)] < rnd[(4, 64)] < rnd[(2, 64)]


def test_model_is_cached(run):
    report, model_dir = run
    assert qm.is_built(model_dir, qm.QUICK_SPEC)
    assert report["model"]["fingerprint"] == qm.QUICK_SPEC.fingerprint()
    # a second build in the same directory reuses it (no retraining)
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert qm.build_quality_model(model_dir, spec=qm.QUICK_SPEC) == model_dir.resolve()
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_data_is_deterministic_and_held_out():
    import numpy as np

    a = qm.heldout_documents(64, 3, spec=qm.QUICK_SPEC)
    b = qm.heldout_documents(64, 3, spec=qm.QUICK_SPEC)
    assert a == b and len(a) == 4 and all(len(ids) == 64 for _, ids in a)
    train = qm.train_documents(qm.QUICK_SPEC, np.random.default_rng([qm.QUICK_SPEC.seed, 1]))
    first = [next(train) for _ in range(50)]
    assert all(len(d) == qm.QUICK_SPEC.seq_len + 1 for d in first)
    held = {tuple(ids) for _, ids in a}
    assert not held & {tuple(d[:64]) for d in first}
    vocab = qm.vocabulary()
    assert vocab[qm.UNK] == "<unk>"
    assert all(0 <= i < len(vocab) for d in first for i in d)
    assert qm.decode(qm.encode("The bread was warm.")) == "The bread was warm."


def test_training_is_reproducible():
    from dataclasses import replace

    import mlx.core as mx
    from mlx.utils import tree_flatten

    spec = replace(qm.QUICK_SPEC, steps=3, warmup=1)
    m1, info1 = qm.train(spec)
    m2, info2 = qm.train(spec)
    w1, w2 = dict(tree_flatten(m1.parameters())), dict(tree_flatten(m2.parameters()))
    assert w1.keys() == w2.keys()
    assert all(mx.array_equal(w1[k], w2[k]).item() for k in w1)
    assert info1["first_loss"] == info2["first_loss"]


def test_the_hybrid_bench_measures_the_state_codec_on_a_trained_hybrid(tmp_path):
    """``--hybrid``: the trained (quick) GatedDeltaNet + attention model, the default codec
    of 8 and 4 bits with the state at full precision and rotated at 8 bits; quantizing the
    state is what takes the 8-bit entry past 1.8x smaller."""
    out, model_dir = tmp_path / "out", tmp_path / "model"
    from kvplugin.tools.bench import state_quality  # `kvplugin bench --quality --hybrid`

    assert state_quality.main(["--hybrid", "--quick", "--out", str(out), "--model-dir",
                               str(model_dir), "--no-progress"]) == 0
    report = json.loads((out / "state.json").read_text())
    rows = {(r["bits"], r["state_quantized"]): r for r in report["rows"]}
    assert set(rows) == {(8, False), (8, True), (4, False), (4, True)}
    for (bits, state), r in rows.items():
        assert r["layers_quantized"] == (2 if state else 1), r
        assert 0 <= r["kl_mean"] <= r["kl_max"] and 0 <= r["greedy_agreement"] <= 1
        if state:
            assert r["stored_bytes"] < 0.7 * rows[(bits, False)]["stored_bytes"], r
    eight = rows[(8, True)]
    assert eight["fp16_bytes"] / eight["stored_bytes"] >= 1.8
    assert eight["codec"].startswith("rotated-channel-k8v8-")  # a hybrid entry's 8-bit default
    assert {g["name"] for g in report["goals"]} >= {
        "8-bit hybrid entry smaller than full precision"}
