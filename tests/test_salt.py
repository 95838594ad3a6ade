"""A request's ``cache_salt`` gives it a namespace of its own in every tier (the engine's part).

The hosts' part (the salt read from a real request, 400 without one) is in the integration
tests ``test_mlx_lm_salt.py`` / ``test_vllm_mlx_salt.py``; here the session decides, with real
mlx-lm caches, a real SSD tier on disk and a real redis-server.
"""

from __future__ import annotations

import json
import struct
import time

import mlx.core as mx
import pytest

from kvplugin.cache.service.salt import SaltRefused, salt_of, salted_key
from kvplugin.cache.service.service import KVService, store_key
from kvplugin.cache.tiers.remote import RemoteTier
from kvplugin.cache.tiers.remote_keys import namespace_of
from kvplugin.cache.tiers.ssd import SSDTier
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import SettingsError, resolve_settings
from kvplugin.tools.redisproc import RedisServer

from kvcaches import filled

BASE = store_key("mlx-lm", "fp-abc", None)
SALT_A, SALT_B = "tenant-a-secret", "tenant-b-secret"


def _service(**flags) -> KVService:
    pm = create_plugin_manager(load_entry_points=False)
    return KVService(resolve_settings(flags), host="mlx-lm", hook=pm.hook, max_bytes=1 << 40)


def test_no_salt_keeps_the_key_and_every_salt_gets_its_own():
    assert salted_key(BASE, None) == BASE  # existing SSD directories and Redis keys stay valid
    a, b = salted_key(BASE, SALT_A), salted_key(BASE, SALT_B)
    assert len({BASE, a, b}) == 3 and a == salted_key(BASE, SALT_A)
    assert a.startswith(BASE + "|salt=") and SALT_A not in a  # hashed, never in clear
    assert salted_key(BASE, "\ud800") != BASE  # any JSON string, even a lone surrogate


def test_a_bad_or_missing_salt_is_refused_naming_the_field():
    assert salt_of({"cache_salt": "x"}, required=True) == "x"
    assert salt_of({}, required=False) is None and salt_of(None, required=False) is None
    for body, required in (({}, True), ({"cache_salt": None}, True), ({"cache_salt": ""}, False),
                           ({"cache_salt": 5}, False), ({"cache_salt": ["a"]}, False),
                           ("not a dict", True)):
        with pytest.raises(SaltRefused, match="'cache_salt'"):
            salt_of(body, required=required)
    svc = _service(kv_cache_require_salt=True)
    with pytest.raises(SaltRefused, match="cache_salt.*--kv-cache-require-salt"):
        svc.request_salt({"messages": []})
    assert "every request needs a cache_salt" in svc.active_line("0", stats_path="/s")
    assert "cache_salt" not in _service().active_line("0", stats_path="/s")


def test_two_salts_never_share_a_prefix_in_the_hot_tier_or_its_lent_snapshots():
    svc = _service()
    a, b = svc.salted_key(BASE, SALT_A), svc.salted_key(BASE, SALT_B)
    system = list(range(100, 400))
    svc.insert(a, system + [1, 2], filled(302))
    assert svc.fetch(b, system + [3, 4]) == (None, 0)  # same prefix, other salt: a miss
    assert svc.fetch(BASE, system + [3, 4]) == (None, 0)  # nor without a salt
    cache, n = svc.fetch(a, system + [3, 4])  # moved to salt a's request: a lent snapshot
    assert n == 300 and cache is not None
    assert svc.fetch(b, system + [5, 6]) == (None, 0)  # the snapshot is salt a's only
    again, m = svc.fetch(a, system + [5, 6])  # salt a may still copy from it
    assert m == 300 and again is not None


def test_a_salted_request_learns_no_prompt_boundary_from_another_salt():
    svc = _service()
    a, b = svc.salted_key(BASE, SALT_A), svc.salted_key(BASE, SALT_B)
    prompt = list(range(500, 560))
    svc.fetch(a, prompt)  # salt a's prompt ends at 60
    svc.insert(b, prompt + [7, 8, 9], filled(63))
    (entry,) = svc.store.snapshot()[1]
    assert entry.prompt_len is None  # not learnt from salt a's request
    svc.fetch(b, prompt)
    svc.insert(b, prompt + [7, 8, 10], filled(63))
    assert {e.prompt_len for e in svc.store.snapshot()[1]} >= {60}


def test_ssd_files_of_two_salts_live_under_different_names_and_never_cross(tmp_path):
    svc = _service(ssd_cache_dir=str(tmp_path))
    keys = {salt: svc.salted_key(BASE, salt) for salt in (None, SALT_A, SALT_B)}
    tokens = list(range(1000, 1200))
    stored = {}
    for salt, key in keys.items():
        stored[salt] = filled(201)
        first_keys = mx.array(stored[salt][0].keys[..., :200, :])  # before the store owns it
        svc.insert(key, tokens + [1], stored[salt])
        stored[salt] = first_keys
    assert svc.store.flush()  # every hot entry spilled to disk
    files = sorted(p for p in tmp_path.rglob("*.safetensors"))
    assert len(files) == 3 and len({p.parent.name for p in files}) == 3
    unsalted_dir = SSDTier.model_dir_name(BASE)
    for p in files:
        raw = p.read_bytes()
        header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        for salt in (SALT_A, SALT_B):
            assert salt not in str(p) and salt.encode() not in raw  # never in clear
        assert header["__metadata__"]["model_key"] in keys.values()
    assert unsalted_dir in {p.parent.name for p in files}  # a saltless request's stays
    svc.store.drop_all()
    for salt in (SALT_B, SALT_A, None):  # each reads its own file, and no other
        got, n = svc.fetch(keys[salt], tokens + [2])
        assert n == 200 and got is not None
        assert mx.array_equal(got[0].keys[..., :200, :], stored[salt]).item(), salt


def test_redis_keys_of_two_salts_differ_and_a_published_entry_stays_its_salts():
    fmt = "full"
    a, b = salted_key(BASE, SALT_A), salted_key(BASE, SALT_B)
    assert namespace_of(BASE, fmt) == namespace_of(store_key("mlx-lm", "fp-abc", None), fmt)
    assert len({namespace_of(k, fmt) for k in (BASE, a, b)}) == 3
    # mlx-lm and vllm-mlx replicas of one checkpoint still share, salt for salt
    assert namespace_of(salted_key(store_key("vllm-mlx", "fp-abc", None), SALT_A), fmt) \
        == namespace_of(a, fmt)
    with RedisServer() as server:
        one = RemoteTier(server.url, entry_format=fmt, block_tokens=64)
        two = RemoteTier(server.url, entry_format=fmt, block_tokens=64)
        try:
            tokens = list(range(3000, 3300))
            assert one.publish(a, tokens, filled(300))
            deadline = time.monotonic() + 10
            while one.stats()["remote_puts"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert two.fetch(b, tokens + [1]) is None
            assert two.fetch(BASE, tokens + [1]) is None
            got = two.fetch(a, tokens + [1])
            assert got is not None and got[1] == 300
            names = [k.decode() for k in server.client().keys("*")]
            assert names and all(k.startswith(namespace_of(a, fmt)) for k in names)
            client = server.client()

            def stored(key: str) -> bytes:  # a value, or a pointer set's members
                if client.type(key) == b"zset":
                    return b"".join(client.zrange(key, 0, -1))
                return client.get(key)

            for salt in (SALT_A, SALT_B):
                assert not any(salt in k for k in names)
                assert all(salt.encode() not in stored(k) for k in names)
        finally:
            one.close()
            two.close()
    mx.clear_cache()


def test_require_salt_comes_from_flag_variable_or_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KVPLUGIN_KV_CACHE_REQUIRE_SALT", raising=False)
    assert resolve_settings().kv_cache_require_salt is False
    (tmp_path / "kvplugin.toml").write_text("kv_cache_require_salt = true\n")
    assert resolve_settings().kv_cache_require_salt is True
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_REQUIRE_SALT", "off")
    assert resolve_settings().kv_cache_require_salt is False  # the variable beats the file
    assert resolve_settings({"kv_cache_require_salt": True}).kv_cache_require_salt is True
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_REQUIRE_SALT", "maybe")
    with pytest.raises(SettingsError, match="--kv-cache-require-salt / "
                                            "KVPLUGIN_KV_CACHE_REQUIRE_SALT"):
        resolve_settings()
