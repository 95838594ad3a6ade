"""The SSD tier's directory-wide rules (kvplugin.cache.tiers.ssd_dir), with two tiers on one
directory standing for two processes (each has its own index, as processes do)."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvplugin.cache.tiers.ssd import SSDTier


def _entry(tokens: int) -> list:
    layer = KVCache()
    k = mx.ones((1, 2, tokens, 64), dtype=mx.float16)
    layer.update_and_fetch(k, k)
    return [layer]


def _disk(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def test_two_tiers_of_two_models_share_one_budget_lru(tmp_path):
    one_entry = 40 * 2 * 2 * 64 * 2 + 4096  # ~44 KB with its header
    a, b = SSDTier(tmp_path, 4 * one_entry), SSDTier(tmp_path, 4 * one_entry)
    for i in range(6):
        assert a.put("model-a", [i] * 40, _entry(40))
        assert b.put("model-b", [i] * 40, _entry(40))
        assert _disk(tmp_path) <= 4 * one_entry
    names = {p.parent.name for p in tmp_path.glob("*/*.safetensors")}
    assert len(names) == 2  # both models keep their most recent entries
    assert a.stats()["evictions"] + b.stats()["evictions"] >= 8
    # an entry the other process evicted is a plain miss here, and leaves the index
    assert a.fetch("model-a", [0] * 40 + [1]) is None
    assert a.stats()["corrupt"] == 0 and a.stats()["unreadable"] == 0


def test_a_dead_writers_temp_file_is_removed_by_the_next_write(tmp_path):
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.put("m", [1, 2, 3], _entry(3))
    mdir = next(tmp_path.glob("*/"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    left = mdir / f".tmp-{dead}-0123abcd.safetensors"
    left.write_bytes(b"x" * 1000)
    live = mdir / f".tmp-{os.getpid()}-4567abcd.safetensors"  # this process: in progress
    live.write_bytes(b"y" * 10)
    assert tier.put("m", [4, 5, 6], _entry(3))
    assert not left.exists() and live.exists()
    assert tier.stats()["leftovers_removed"] == 1


def test_symlinks_are_never_followed_and_modes_are_the_operators(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    tier = SSDTier(root, 1 << 30)
    assert tier.put("m", [1, 2, 3], _entry(3))
    (entry,) = root.glob("*/*.safetensors")
    mdir = entry.parent
    assert root.stat().st_mode & 0o777 == 0o755
    assert mdir.stat().st_mode & 0o777 == 0o700 and entry.stat().st_mode & 0o777 == 0o600
    mdir.chmod(0o750)  # the operator's choice
    assert tier.put("m", [7, 8, 9], _entry(3))
    assert mdir.stat().st_mode & 0o777 == 0o750  # not set back on a write
    outside = tmp_path / "outside.safetensors"
    entry.rename(outside)
    entry.symlink_to(outside)
    again = SSDTier(root, 1 << 30)
    assert len(again) == 1 and again.stats()["symlinks"] == 1  # the link is not indexed
    assert again.fetch("m", [1, 2, 3, 4]) is None
    assert outside.exists() and entry.is_symlink()
