"""Sliding-window and hybrid recurrent models on real ``mlx-openai-server launch`` processes,
and a restart over a kept ``--prompt-cache-dir``: stock beside kvplugin.

Per family (Gemma 3: ``RotatingKVCache`` windows that the system prompt wraps; Qwen3-Next:
GatedDeltaNet ``ArraysCache`` state beside attention), the same greedy chat on a fresh stock
server and on kvplugin: conversation A, then B (A's entry goes to its file), A again (from the
file), A again (from memory). At fp16 the answers are stock's and every turn reuses at least
the prompt tokens stock reuses; with ``--kv-cache-quantization-bits 8`` the entries are stored
quantized and the server still reuses at least as much.

Restart (Gemma 3): the fp16 server is stopped as by Ctrl-C and a new one started on the same directory:
A's next turn is served from the previous process's file (the conversation held in memory
when it stopped is written out too) and reuses as much as stock's does without a restart; B's
files, damaged in between, are a counted miss; both answer as stock's. Stock deletes its
pickles at shut-down (and never reads a directory's old ones), so its own restart reuses
nothing.
"""

from __future__ import annotations

import json
import os
import signal
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from harness import answer_text, cached_tokens, mlx_openai_server_cmd

from kvplugin.tools.models.corpus import CORPUS
from kvplugin.tools.models.families import build_family_model

FAMS = ("gemma3_text", "qwen3_next")
# restarted too (a server start each): the files are the ones the in-process turns read back
RESTARTED = {"gemma3_text"}
SYSTEM = " ".join(CORPUS.split()[:120])  # past the 128-token sliding window: it wraps
A = ("Where is the river?", "And the hills?", "Who lives there?", "What do they grow?")
B = ("Describe the harbour at dawn.", "What do the boats carry?")
# (conversation, turn) in the order asked: B's first turn sends A's entry to its file
BEFORE_RESTART = (("a", 0), ("b", 0), ("a", 1), ("a", 2))
AFTER_RESTART = (("a", 3), ("b", 1))
MAX_TOKENS = 6


class Chat:
    """The two conversations' messages on one server, and each turn's answer and reuse."""

    def __init__(self, srv: Any) -> None:
        self.srv = srv
        self.messages = {w: [{"role": "system", "content": SYSTEM}] for w in "ab"}
        self.out: list[tuple[str, int]] = []

    def turns(self, order: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        for who, i in order:
            messages = self.messages[who]
            messages.append({"role": "user", "content": (A if who == "a" else B)[i]})
            response = self.srv.chat(messages, max_tokens=MAX_TOKENS)
            messages.append({"role": "assistant", "content": answer_text(response)})
            self.out.append((answer_text(response), cached_tokens(response) or 0))
        return self.out[-len(order):]


def ctrl_c(srv: Any) -> None:
    """A user's Ctrl-C: the host's orderly shut-down (its prompt cache is closed)."""
    os.killpg(srv.pid, signal.SIGINT)
    srv.proc.wait(timeout=60)


def _tensors(raw: bytes) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), 8 + size


def entry_tokens(path: Path) -> list[int]:
    """The tokens an entry file is for (its ``__tokens__`` tensor)."""
    raw = path.read_bytes()
    header, base = _tensors(raw)
    start, end = header["__tokens__"]["data_offsets"]
    return array("q", raw[base + start:base + end]).tolist()


def damage(path: Path) -> None:
    """Flip bytes of a layer's data (the header and tokens stay valid: only the digest can
    tell)."""
    raw = bytearray(path.read_bytes())
    header, base = _tensors(bytes(raw))
    start, end = next(t["data_offsets"] for name, t in sorted(header.items())
                      if name not in ("__tokens__", "__metadata__"))
    for i in range(base + start, min(base + end, base + start + 32)):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def damage_the_others(kept: Path) -> list[Path]:
    """Damage every entry file whose tokens are not a prefix of the longest entry's (another
    conversation's); returns them."""
    files = {p: entry_tokens(p) for p in kept.rglob("*.safetensors")}
    a = max(files.values(), key=len)
    others = [p for p, t in files.items() if t != a[:len(t)]]
    for p in others:
        damage(p)
    return others


@pytest.fixture(scope="module", params=FAMS)
def family(request, tmp_path_factory):
    return request.param, build_family_model(request.param,
                                             tmp_path_factory.mktemp(request.param) / "model")


@pytest.fixture(scope="module")
def stock_chat(family, start_server, tmp_path_factory):
    """Stock's answers and reuse for every turn, in one process (no restart), and whether its
    directory kept a pickle past its shut-down."""
    name, model = family
    pickles = tmp_path_factory.mktemp(f"stock-{name}")
    srv = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(pickles),
                       env={"KVPLUGIN_DISABLE": "1"}, model_dir=model)
    chat = Chat(srv)
    chat.turns(BEFORE_RESTART + AFTER_RESTART)
    assert list(pickles.glob("*.pkl")), "stock wrote no pickle: the comparison proves nothing"
    ctrl_c(srv)
    return chat.out, list(pickles.glob("*.pkl"))


def test_fp16_answers_as_stock_from_a_file_and_from_memory_and_after_a_restart(
        family, stock_chat, start_server, tmp_path):
    """The restart half for the families in ``RESTARTED``."""
    name, model = family
    theirs, stock_kept = stock_chat
    kept = tmp_path / "prompt-cache"
    srv = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(kept), model_dir=model)
    ours = Chat(srv).turns(BEFORE_RESTART)
    assert [t for t, _ in ours] == [t for t, _ in theirs[:4]], name
    assert all(o[1] >= t[1] for o, t in zip(ours, theirs)), (name, ours, theirs)
    assert ours[2][1] > 0 and ours[3][1] > 0, (name, ours)  # from the file, from memory
    stats = srv.get("/kvplugin/stats")
    assert stats["store_cold_hits"] >= 1 and stats["store_moved"] >= 1, stats
    assert stats["store_rejected"] == 0 and stats["cold_refused"] == 0, stats
    ctrl_c(srv)
    if name not in RESTARTED:
        return

    assert damage_the_others(kept), list(kept.rglob("*"))  # B's files (A's is the longest)
    again = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(kept),
                         model_dir=model)
    chat = Chat(again)
    for who, i in BEFORE_RESTART:  # the history the new process continues
        chat.messages[who] += [{"role": "user", "content": (A if who == "a" else B)[i]},
                               {"role": "assistant", "content": ours.pop(0)[0]}]
    after = chat.turns(AFTER_RESTART)
    assert [t for t, _ in after] == [t for t, _ in theirs[4:]], (name, after, theirs)
    stats = again.get("/kvplugin/stats")
    assert stats["store_cold_hits"] >= 1 and stats["cold_corrupt"] >= 1, stats
    # A's next turn, from the previous process's file: as much as stock reuses without a restart
    assert after[0][1] >= theirs[4][1] > 0, (after, theirs)
    assert not stock_kept, stock_kept  # stock's own restart would reuse nothing
    ctrl_c(again)


def test_8bit_entries_are_quantized_and_reuse_at_least_stocks(family, stock_chat,
                                                              start_server, tmp_path):
    name, model = family
    theirs, _ = stock_chat
    srv = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(tmp_path / "q"),
                       "--kv-cache-quantization-bits", "8", "--kv-cache-min-quantize-tokens", "0",
                       model_dir=model)
    ours = Chat(srv).turns(BEFORE_RESTART)
    assert all(a.strip() for a, _ in ours), ours
    assert all(o[1] >= t[1] for o, t in zip(ours, theirs)), (name, ours, theirs)
    stats = srv.get("/kvplugin/stats")
    assert stats["entries_quantized"] >= 2 and stats["store_cold_hits"] >= 1, stats
    assert stats["store_rejected"] == 0 and stats["cold_refused"] == 0, stats
    ctrl_c(srv)
