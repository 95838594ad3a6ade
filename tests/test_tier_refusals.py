"""A tier that refuses an entry says so once, naming the layer class and why, and counts it by
reason (``refused_by_reason``), which ``kvplugin info --server URL`` shows too."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvplugin import cli
from kvplugin.cache.bounded.prealloc import PreallocatedRotatingKVCache
from kvplugin.cache.tiers.serialize import Unsupported, serialize_cache
from kvplugin.cache.tiers.ssd import SSDTier
from kvplugin.log import forget

H, D = 2, 32
DT = mx.float16
MODEL = "mlx-lm|fp|max_kv=64"


class TaggedKVCache(KVCache):
    """A plugin's layer class holding live state (a list) the format cannot represent."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []


def _tagged(tokens: int) -> list:
    layer = TaggedKVCache()
    k = mx.zeros((1, H, tokens, D), DT)
    layer.update_and_fetch(k, k)
    return [layer]


def _refusal_lines(err: str, *words: str) -> list[str]:
    return [line for line in err.splitlines()
            if line.startswith("kvplugin:") and all(w in line for w in words)]


def test_the_serializer_names_the_layer_class_and_the_reason():
    with pytest.raises(Unsupported) as e:
        serialize_cache(_tagged(4))
    assert e.value.kind == "TaggedKVCache" and "notes" in e.value.why


def test_a_layer_the_cold_tier_cannot_hold_is_said_once_and_counted_by_reason(tmp_path, capsys):
    forget()
    tier = SSDTier(tmp_path, 1 << 30)
    assert not tier.put(MODEL, list(range(8)), _tagged(8))
    assert not tier.put(MODEL, list(range(9)), _tagged(9))
    stats = tier.stats()
    assert stats["refused"] == 2 and stats["puts"] == 0
    assert stats["refused_by_reason"] == {"unsupported:TaggedKVCache": 2}
    lines = _refusal_lines(capsys.readouterr().err, "TaggedKVCache")
    assert len(lines) == 1, lines
    assert str(tmp_path) in lines[0] and "notes" in lines[0]


def test_an_entry_over_the_cold_budget_is_said_once_and_counted_by_reason(tmp_path, capsys):
    forget()
    tier = SSDTier(tmp_path, 4096)
    for n in (40, 41):
        layer = PreallocatedRotatingKVCache(64, 4)
        k = mx.zeros((1, H, n, D), DT)
        layer.update_and_fetch(k, k)
        assert not tier.put(MODEL, list(range(n)), [layer])
    assert tier.stats()["refused_by_reason"] == {"over_budget": 2}
    lines = _refusal_lines(capsys.readouterr().err, "budget", "--ssd-cache-max-gb")
    assert len(lines) == 1, lines


def test_a_layer_the_remote_tier_cannot_hold_is_said_once_and_counted_by_reason(capsys):
    from kvplugin.cache.tiers.remote import RemoteTier
    from kvplugin.tools.redisproc import RedisServer

    forget()
    with RedisServer() as server:
        tier = RemoteTier(server.url, entry_format="full", block_tokens=4)
        try:
            assert not tier.publish(MODEL, list(range(8)), _tagged(8))
            assert not tier.publish(MODEL, list(range(9)), _tagged(9))
            stats = tier.stats()
        finally:
            tier.close()
    assert stats["remote_refused"] == 2 and stats["remote_queued_bytes"] == 0
    assert stats["remote_refused_by_reason"] == {"unsupported:TaggedKVCache": 2}
    lines = _refusal_lines(capsys.readouterr().err, "TaggedKVCache", "remote tier")
    assert len(lines) == 1 and "shares no entry" in lines[0], lines


@pytest.fixture
def stats_server():
    """A real HTTP server on 127.0.0.1 answering ``GET /kvplugin/stats`` with ``body``."""
    body: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            raw = json.dumps(body).encode()
            self.send_response(200 if self.path == "/kvplugin/stats" else 404)
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", body
    server.shutdown()
    server.server_close()


def test_info_shows_what_a_running_server_refused_by_reason(stats_server, capsys):
    url, body = stats_server
    body.update({"cold_tier": {"refused": 3, "refused_by_reason": {
        "unsupported:TaggedKVCache": 2, "over_budget": 1}, "remote_refused_by_reason": {}},
        "rejected_by_kind": {"ArraysCache,KVCache": 1}})
    assert cli.main(["info", "--server", url]) == 0
    out = capsys.readouterr().out
    assert f"refused by the server at {url}" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "over_budget: 1, unsupported:TaggedKVCache: 2" in out
    assert "remote tier" in out and "nothing" in rows["remote"]
    assert "ArraysCache,KVCache: 1" in rows["store"]
    body.clear()
    body["cold_tier"] = None
    assert cli.main(["info", "--server", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["refusals"] == {
        "url": url, "cold_tier": None, "remote_tier": None, "store_rejected_by_kind": None}


def test_info_with_a_server_it_cannot_read_exits_2_naming_the_flag(stats_server, capsys):
    url, _ = stats_server
    assert cli.main(["info", "--server", url + "/nothing-here"]) == 2
    err = capsys.readouterr().err
    assert "--server" in err and "/kvplugin/stats" in err
