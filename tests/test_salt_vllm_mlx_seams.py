"""vllm-mlx's ``cache_salt`` seams on their own: the body middleware (400 under
``--kv-cache-require-salt``, the body replayed unchanged) and the owner of a batched store.

The real servers are in ``integration/test_vllm_mlx_salt.py``.
"""

from __future__ import annotations

import asyncio
import types

from kvplugin.cache.service.service import KVService
from kvplugin.hosts.vllm_mlx import salt
from kvplugin.settings import resolve_settings



def test_a_batched_store_belongs_to_the_one_salt_whose_request_holds_its_tokens():
    """``--continuous-batching`` stores name no request: the owner is found among the
    scheduler's requests, and a store two salts could own is not made."""

    def req(salt, prompt, output=(), extracted=None):
        r = types.SimpleNamespace(prompt_token_ids=list(prompt), output_token_ids=list(output),
                                  _extracted_cache=extracted)
        setattr(r, salt_attr, salt)
        return r

    salt_attr = salt._ATTR
    system = list(range(100))
    sched = types.SimpleNamespace(requests={})
    assert salt.owner_salt(sched, system, []) is None  # nothing in flight: as today
    sched.requests = {"1": req(None, system + [1]), "2": req(None, system + [2])}
    assert salt.owner_salt(sched, system, []) is None  # no salted request: as today
    cache = ["layers of request 3"]
    sched.requests = {"1": req("a", system + [1], [7, 8]), "2": req("b", system + [2]),
                      "3": req("b", system + [1], [7], extracted=cache)}
    assert salt.owner_salt(sched, system + [1, 7, 8], []) == "a"  # prompt + output so far
    assert salt.owner_salt(sched, system + [2], []) == "b"
    assert salt.owner_salt(sched, system + [1, 7], cache) == "b"  # its extracted cache
    assert salt.owner_salt(sched, system + [1, 7], []) is salt.UNKNOWN  # a's or b's: neither
    assert salt.owner_salt(sched, system, []) is salt.UNKNOWN
    assert salt.owner_salt(sched, [5, 5, 5], []) is salt.UNKNOWN  # nobody's


def test_a_saltless_request_is_refused_400_naming_the_field_under_require_salt():
    """The middleware reads the body and replays it unchanged to the host's app."""
    from kvplugin.plugins import create_plugin_manager

    pm = create_plugin_manager(load_entry_points=False)
    service = KVService(resolve_settings({"kv_cache_require_salt": True}), host="vllm-mlx",
                        hook=pm.hook)
    adapter = types.SimpleNamespace(runtime=types.SimpleNamespace(service=service))
    seen = []

    async def app(scope, receive, send):
        seen.append((salt.request_salt(), (await receive())["body"]))

    async def call(body: bytes, path="/v1/chat/completions"):
        sent = []
        chunks = [{"type": "http.request", "body": body[:5], "more_body": True},
                  {"type": "http.request", "body": body[5:], "more_body": False}]

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path}
        await salt.SaltMiddleware(app, adapter)(scope, receive, send)
        return sent

    sent = asyncio.run(call(b'{"messages": []}'))
    assert sent[0]["status"] == 400 and b"cache_salt" in sent[1]["body"] and not seen
    assert asyncio.run(call(b'{"cache_salt": "t1", "messages": []}')) == []
    assert seen[-1][0] == "t1" and seen[-1][1] == b'{"cac'  # replayed as it came
    asyncio.run(call(b'{"messages": []}', path="/v1/embeddings"))  # no generation: untouched
    assert seen[-1][0] is None and salt.request_salt() is None
