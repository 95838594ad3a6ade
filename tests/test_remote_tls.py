"""The remote tier over TLS, logged in as an ACL user, against a real ``redis-server``.

The server gets a certificate made at start by ``openssl`` and signed by a throw-away CA; the
client is told that CA with ``?ssl_ca_certs=`` in the URL (redis-py takes TLS options from the
query). Misconfigurations a server would otherwise run around as "Redis down" (a CA that does
not sign the server's certificate, a missing CA file, a TLS option on ``redis://``) are
start-up errors naming the flag and the variable; the password is never printed.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvplugin.cache.tiers.remote import RemoteTier
from kvplugin.resources import masked_url
from kvplugin.settings import SettingsError, resolve_settings
from kvplugin.tools.redisproc import RedisServer

MODEL = "mlx-lm|fp-tls|max_kv=0"
USER, PASSWORD = "replica", "pw-7d1e0c5b9a"
FLAG_AND_ENV = ("--kv-cache-remote", "KVPLUGIN_KV_CACHE_REMOTE")


@pytest.fixture(scope="module")
def tls_server():
    with RedisServer(tls=True, username=USER, password=PASSWORD) as server:
        yield server


def _entry(tokens: int) -> list:
    layer = KVCache()
    k = mx.random.normal((1, 2, tokens, 64)).astype(mx.float16)
    layer.update_and_fetch(k, k)
    return [layer]


def test_replicas_share_an_entry_over_tls_as_an_acl_user(tls_server, caplog):
    url = tls_server.url
    assert url.startswith(f"rediss://{USER}:{PASSWORD}@127.0.0.1:") and "ssl_ca_certs=" in url
    assert resolve_settings({"kv_cache_remote": url}).kv_cache_remote == url
    with caplog.at_level(logging.DEBUG, logger="kvplugin"):
        a = RemoteTier(url, entry_format="full", block_tokens=64)
        b = RemoteTier(url, entry_format="full", block_tokens=64)
        try:
            tokens = list(range(400))
            assert a.publish(MODEL, tokens, _entry(400))
            deadline = time.monotonic() + 10
            while a.stats()["remote_puts"] < 1:
                assert time.monotonic() < deadline, a.stats()
                time.sleep(0.01)
            got = b.fetch(MODEL, tokens + [1])
            assert got is not None and got[1] == 400
            stats = b.stats()
            assert stats["remote_connected"] == 1 and stats["remote_url"] == masked_url(url)
            assert PASSWORD not in str(stats) and f"{USER}:***@" in stats["remote_url"]
        finally:
            a.close()
            b.close()
    assert "reachable" in caplog.text and PASSWORD not in caplog.text
    assert tls_server.client().acl_whoami() == USER


@pytest.mark.parametrize("change, why", [
    (lambda url: url.split("?")[0], "certificate"),  # no CA: the system's do not sign it
    (lambda url: url.replace(PASSWORD, "not-" + PASSWORD), "refused the credentials"),
    (lambda url: url + "&no_such_option=1", "no_such_option"),
], ids=["unknown-ca", "wrong-password", "unknown-option"])
def test_a_misconfigured_tls_url_stops_the_start_naming_the_flag(tls_server, change, why):
    with pytest.raises(SettingsError) as err:
        RemoteTier(change(tls_server.url), entry_format="full")
    text = str(err.value)
    assert why in text and all(s in text for s in FLAG_AND_ENV), text
    assert PASSWORD not in text, text


def test_tls_files_are_checked_before_the_server_listens(tls_server, tmp_path):
    for url, why in ((tls_server.url.replace(str(tls_server.ca_file), str(tmp_path / "x.pem")),
                      "cannot be read"),
                     (tls_server.url.replace("rediss://", "redis://"), "use rediss://")):
        with pytest.raises(SettingsError) as err:
            resolve_settings({"kv_cache_remote": url})
        text = str(err.value)
        assert why in text and all(s in text for s in FLAG_AND_ENV), text
        assert PASSWORD not in text, text


def test_every_password_in_a_url_is_masked():
    assert masked_url("rediss://u:s3cret@[::1]:6380/0?ssl_ca_certs=/c.pem") == \
        "rediss://u:***@[::1]:6380/0?ssl_ca_certs=/c.pem"
    assert masked_url("redis://h:1/0?password=s3cret&db=1") == "redis://h:1/0?password=***&db=1"
    assert masked_url("redis://h:1/0?ssl_password=s3cret") == "redis://h:1/0?ssl_password=***"
    assert "s3cret" not in masked_url("redis://:s3cret@h:bad/0")
