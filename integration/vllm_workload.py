"""The conversation workload both vllm-mlx integration modules drive (one definition)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request

from harness import answer_text

SYSTEM = {"role": "system", "content": "You are a careful assistant that knows the garden. " * 14}


def stats(srv) -> dict:
    return srv.get("/kvplugin/stats")


def stream_chat(srv, messages, max_tokens=10) -> str:
    body = {"model": srv.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    text = ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
    return text


def conversation(srv, i: int, turns: int = 2, max_tokens: int = 10) -> list[str]:
    """A multi-turn chat sharing SYSTEM with every other conversation; returns the answers."""
    history, answers = [SYSTEM], []
    for t in range(turns):
        history.append({"role": "user", "content": f"Visitor {i} asks ({t}): what about bed {i * 7 + t}?"})
        a = answer_text(srv.chat(history, max_tokens=max_tokens))
        answers.append(a)
        history.append({"role": "assistant", "content": a})
    return answers


def workload(srv, *, stream: bool = True) -> list[str]:
    """Cold prompts, multi-turn reuse, exact repeats, completions and a streamed chat."""
    out = []
    for i in range(3):
        out += conversation(srv, i, turns=3)
    long_user = "hello there, tell me everything about the old bridge. " * 25
    for _ in range(2):
        out.append(answer_text(srv.chat(long_user, max_tokens=12)))
        out.append(answer_text(srv.complete("the cat sat on the mat by the door " * 25, max_tokens=12)))
    if stream:
        out.append(stream_chat(srv, [SYSTEM, {"role": "user", "content": "Visitor 0 asks (0): what about bed 0?"}]))
    return out


def assert_no_contamination(stock, plain) -> None:
    """24 requests (12 two-turn conversations sharing a 240-token prefix), all at once on
    ``plain``; each must answer exactly what ``stock`` answers for it alone, and the shared
    prefix must really have been reused."""
    expected = [conversation(stock, i) for i in range(100, 112)]
    before = stats(plain)
    with cf.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda i: conversation(plain, i), range(100, 112)))
    assert got == expected
    after = stats(plain)
    assert after["store_hits"] - before["store_hits"] >= 12, after
