"""Flipped bytes inside an SSD entry's tensor data are caught before use, never served.

A header check catches truncation; it does not catch damage inside the data, which changed
answers silently (and got copied into newer entries). Every file now carries a digest of
its tensors, verified on every read.
"""

from __future__ import annotations

import json
import struct

import mlx.core as mx

from kvplugin.cache.tiers import ssd as ssd_mod
from kvplugin.cache.tiers.ssd import SSDTier

from test_store import _mdir, kv, seq  # noqa: F401  (the store tests' helpers)


def flip_in_tensor(path, name: str = "l0.keys", at: int = 5) -> None:
    """Flip bytes inside one tensor's data, leaving the header valid."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    start, end = header[name]["data_offsets"]
    pos = 8 + n + start + at
    assert pos + 4 <= 8 + n + end
    path.write_bytes(raw[:pos] + bytes(b ^ 0xFF for b in raw[pos:pos + 4]) + raw[pos + 4:])


def test_digest_is_recorded_and_stable(tmp_path):
    cold = SSDTier(tmp_path / "c", max_bytes=1 << 30)
    t = seq(0, 40)
    assert cold.put("m", t, kv(t))
    path = _mdir(cold, "m") / ssd_mod._key_name(tuple(t))
    meta = ssd_mod._read_header(path)[1]
    assert meta["format"] == "kvplugin.cache/2" and meta["digest"].startswith("blake2b:")
    assert ssd_mod.tensor_digest(mx.load(str(path))) == meta["digest"]


def test_flipped_tensor_bytes_are_a_counted_miss_and_the_file_goes(tmp_path):
    cold = SSDTier(tmp_path / "c", max_bytes=1 << 30)
    a, b = seq(0, 40), seq(500, 40)
    assert cold.put("m", a, kv(a)) and cold.put("m", b, kv(b))
    pa = _mdir(cold, "m") / ssd_mod._key_name(tuple(a))
    pb = _mdir(cold, "m") / ssd_mod._key_name(tuple(b))
    flip_in_tensor(pa)  # moved (prefix) hit
    assert cold.fetch("m", a + [1]) is None and not pa.exists()
    flip_in_tensor(pb, "l1.values")  # common-prefix copy
    assert cold.fetch("m", b[:20] + [9, 9]) is None and not pb.exists()
    stats = cold.stats()
    assert stats["corrupt"] == 2 and stats["hits"] == 0 and len(cold) == 0


def test_undamaged_files_still_serve(tmp_path):
    cold = SSDTier(tmp_path / "c", max_bytes=1 << 30)
    t = seq(0, 40)
    cache = kv(t)
    want = mx.array(cache[0].keys[..., :40, :])
    assert cold.put("m", t, cache)
    got, n = cold.fetch("m", t + [1])
    assert n == 40 and mx.array_equal(got[0].keys[..., :40, :], want)
