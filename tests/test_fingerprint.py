"""The store's model key."""

from __future__ import annotations

from kvplugin.cache.model import fingerprint as fp


def test_model_fingerprint(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"x" * 10)
    key = fp.model_fingerprint((str(d), None, None))
    assert key.startswith("my-model-") and key == fp.model_fingerprint((str(d), None, None))
    fp._FINGERPRINTS.clear()
    assert fp.model_fingerprint((str(d), None, None)) == key  # stable across processes
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"a": 2}')
    assert fp.model_fingerprint((str(other), None, None)) != key
    assert fp.model_fingerprint((str(d), str(other), None)) != key  # an adapter counts
    (d / "config.json").write_text('{"a": 3}')  # a changed checkpoint
    fp._FINGERPRINTS.clear()
    assert fp.model_fingerprint((str(d), None, None)) != key
    copy = tmp_path / "copy" / "my-model"  # the same files elsewhere: the same key (replicas)
    copy.parent.mkdir()
    import shutil

    shutil.copytree(d, copy)
    fp._FINGERPRINTS.clear()
    key = fp.model_fingerprint((str(d), None, None))
    assert fp.model_fingerprint(str(copy)) == key  # vllm-mlx passes the path alone
    (copy / "model.safetensors").write_bytes(b"y" * 10)  # other weights, same size
    fp._FINGERPRINTS.clear()
    assert fp.model_fingerprint(str(copy)) != key
    remote = fp.model_fingerprint(("org/repo-not-cached", None, None))
    assert remote.startswith("repo-not-cached-")
    assert fp.model_fingerprint(object()).startswith("model-")

