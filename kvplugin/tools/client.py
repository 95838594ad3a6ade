"""The client side of the tools: streamed and timed chat requests, kvplugin's stats route.

Shared by ``kvplugin demo`` and ``kvplugin bench --server``; stdlib only, so a benchmark
that drives real host processes needs nothing beyond the server harness
(:mod:`kvplugin.tools.hostproc`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from kvplugin.tools import hostproc
from kvplugin.tools.hostproc import ServerProcess

__all__ = ["STATS_PATH", "Reply", "at_once", "stream_chat", "timed_chat", "get_stats"]

STATS_PATH = "/kvplugin/stats"


@dataclass
class Reply:
    """One chat request as the client saw it (times in seconds from sending the request)."""

    text: str = ""
    ttft_s: float | None = None  # first streamed token (streaming) / whole request (1 token)
    total_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    streamed: bool = True

    @property
    def decode_tps(self) -> float | None:
        """Tokens per second between the first and the last streamed token."""
        n = self.completion_tokens or len(self.token_times)
        if not self.token_times or n < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return (n - 1) / span if span > 0 else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("token_times")
        out["decode_tps"] = self.decode_tps
        return out


def _body(srv: ServerProcess, messages: Sequence[Mapping[str, Any]], max_tokens: int,
          stream: bool, seed: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": list(messages), "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": stream}
    if seed is not None:  # mlx-lm serves seeded requests on its sequential path
        body["seed"] = seed
    if stream:
        body["stream_options"] = {"include_usage": True}
    if srv.model is not None:
        body["model"] = srv.model
    return body


def _usage(reply: Reply, usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    reply.prompt_tokens = usage.get("prompt_tokens", reply.prompt_tokens)
    reply.completion_tokens = usage.get("completion_tokens", reply.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        reply.cached_tokens = int(details["cached_tokens"])


def stream_chat(srv: ServerProcess, messages: Sequence[Mapping[str, Any]], max_tokens: int = 16,
                timeout: float | None = None, seed: int | None = None,
                **fields: Any) -> Reply:
    """POST a streamed chat completion (``fields``: more of the body, e.g. ``cache_salt``);
    time the first and every content chunk."""
    data = json.dumps({**_body(srv, messages, max_tokens, True, seed), **fields}).encode()
    req = urllib.request.Request(srv.url + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    reply = Reply()
    t0 = time.perf_counter()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout or srv.request_timeout)
    except urllib.error.HTTPError as e:
        raise hostproc.ServerHTTPError("POST", req.full_url, e.code,
                                       e.read().decode(errors="replace")) from None
    with resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank lines and ": keepalive" comments during prefill
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            now = time.perf_counter() - t0
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if content is None:
                    content = choice.get("text")
                if content:
                    if reply.ttft_s is None:
                        reply.ttft_s = now
                    reply.token_times.append(now)
                    reply.text += content
            _usage(reply, chunk.get("usage"))
    reply.total_s = time.perf_counter() - t0
    return reply


def timed_chat(srv: ServerProcess, messages: Sequence[Mapping[str, Any]], max_tokens: int = 1,
               timeout: float | None = None) -> Reply:
    """A non-streamed chat completion, timed as a whole (``ttft_s`` = ``total_s``)."""
    t0 = time.perf_counter()
    out = srv.chat(list(messages), max_tokens=max_tokens, temperature=0.0, timeout=timeout)
    reply = Reply(streamed=False)
    reply.total_s = reply.ttft_s = time.perf_counter() - t0
    reply.text = hostproc.answer_text(out)
    _usage(reply, out.get("usage"))
    return reply


def get_stats(srv: ServerProcess) -> dict[str, Any] | None:
    """``GET /kvplugin/stats`` as a dict, or None when the route does not answer JSON."""
    try:
        status, body = srv.request("GET", STATS_PATH, timeout=30)
    except OSError:
        return None
    if status != 200 or not isinstance(body, dict) or body.get("active") is False:
        return None
    return body


def at_once(*calls: Any, timeout: float = 300.0) -> list:
    """Run each ``call(barrier)`` in its own thread, together (each may wait on the shared
    ``threading.Barrier`` so their requests meet the server at once); their results in order,
    or the first error raised again. Why: a concurrency check must fail, not hang, when one
    side dies."""
    import threading

    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i](barrier)
        except BaseException as exc:  # noqa: BLE001 - raised again below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if errors:
        raise errors[0]
    return results
