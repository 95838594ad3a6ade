"""Real ``mlx-openai-server launch`` processes on the tiny model: stock beside kvplugin.

Multi-turn chats, serial and concurrent, answer exactly as stock's (fp16) and reuse at least
the prompt tokens stock reuses (the host reports them in ``usage.prompt_tokens_details.
cached_tokens``); stock pickles every entry into ``--prompt-cache-dir``, kvplugin writes no
pickle there, ever.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import harness
import pytest
from harness import answer_text, cached_tokens, mlx_openai_server_cmd

TURNS = ("Tell me about the old stone bridge.", "Why was it built there?",
         "Who repairs it now?")
OTHER = ("Describe the harbour at dawn.", "What do the boats carry?")


def _dir(tmp_path_factory, name: str):
    return tmp_path_factory.mktemp(name) / "prompt-cache"


@pytest.fixture(scope="module")
def stock_dir(tmp_path_factory):
    return _dir(tmp_path_factory, "stock")


@pytest.fixture(scope="module")
def kvp_dir(tmp_path_factory):
    return _dir(tmp_path_factory, "kvplugin")


@pytest.fixture(scope="module")
def stock(start_server, stock_dir):
    return start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(stock_dir),
                        env={"KVPLUGIN_DISABLE": "1"})


@pytest.fixture(scope="module")
def kvp(start_server, kvp_dir):
    return start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(kvp_dir))


def conversation(srv, turns, max_tokens: int = 12) -> list[tuple[str, int]]:
    """Each turn's answer and the prompt tokens the server says it reused."""
    messages, out = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        response = srv.chat(messages, max_tokens=max_tokens)
        answer = answer_text(response)
        out.append((answer, cached_tokens(response)))
        messages.append({"role": "assistant", "content": answer})
    return out


def test_the_host_is_installed():
    assert harness.host_version("mlx-openai-server") == "1.8.1"


def test_a_serial_chat_answers_as_stock_and_reuses_at_least_as_much(stock, kvp):
    ours, theirs = conversation(kvp, TURNS), conversation(stock, TURNS)
    assert [a for a, _ in ours] == [a for a, _ in theirs]
    assert all(a.strip() for a, _ in ours), ours
    for (_, mine), (_, stocks) in zip(ours, theirs):
        assert mine is not None and stocks is not None
        assert mine >= stocks, (ours, theirs)
    assert sum(n for _, n in ours[1:]) > 0, ours  # later turns reuse the earlier ones
    stats = kvp.get("/kvplugin/stats")
    assert stats["store_hits"] >= len(TURNS) - 1, stats
    assert "kvplugin: active on mlx-openai-server 1.8.1" in kvp.log_text()


def test_concurrent_chats_answer_as_stock(stock, kvp):
    serial = {turns: conversation(stock, turns) for turns in (TURNS[:2], OTHER)}
    with ThreadPoolExecutor(2) as pool:
        both = dict(zip(serial, pool.map(lambda t: conversation(kvp, t), serial)))
    for turns, answers in both.items():
        assert [a for a, _ in answers] == [a for a, _ in serial[turns]], turns
        assert answers[-1][1] >= serial[turns][-1][1], (answers, serial[turns])


def test_stock_pickles_its_entries_and_kvplugin_never_does(stock, kvp, stock_dir, kvp_dir):
    conversation(stock, TURNS[:1])
    conversation(kvp, TURNS[:1])
    assert list(stock_dir.glob("*.pkl")), "stock wrote no pickle: the comparison proves nothing"
    assert not [p for p in kvp_dir.rglob("*") if p.suffix in (".pkl", ".tmp")]


def test_metrics_are_kvplugins_series(kvp):
    text = kvp.get("/metrics")
    assert "kvplugin_entries_stored_total" in text, text[:500]


def test_the_ssd_tier_holds_checked_files_and_serves_them(start_server, tmp_path):
    cache_dir = tmp_path / "tier"
    srv = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(cache_dir),
                       "--prompt-cache-size", "1")
    first = conversation(srv, TURNS[:1])
    conversation(srv, OTHER[:1])  # evicts the first conversation to the SSD tier
    again = srv.chat([{"role": "user", "content": TURNS[0]},
                      {"role": "assistant", "content": first[0][0]},
                      {"role": "user", "content": TURNS[1]}], max_tokens=4)
    stats = srv.get("/kvplugin/stats")
    assert stats["store_spills"] >= 1 and stats["store_cold_hits"] >= 1, stats
    assert cached_tokens(again) > 0, again
    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files), files
    assert not any(p.suffix == ".pkl" for p in files), files


def test_the_single_request_path_answers_as_stock_and_reuses_at_least_as_much(start_server,
                                                                              stock):
    srv = start_server(mlx_openai_server_cmd, "--disable-batching")
    turns = ("Tell me about the mill by the river.", "Who owns it?")  # new to both servers
    ours, theirs = conversation(srv, turns), conversation(stock, turns)
    assert [a for a, _ in ours] == [a for a, _ in theirs]
    assert ours[-1][1] >= theirs[-1][1] > 0, (ours, theirs)
    assert srv.get("/kvplugin/stats")["store_hits"] >= 1


def test_entries_are_files_between_conversations_as_stock_and_answer_as_stock(
        start_server, tmp_path):
    """Stock holds no entry in memory; kvplugin holds only the conversation that just ended,
    until another request: the rest are checked files, in a private directory removed at
    shut-down. A turn served from a file or from memory answers as stock's."""
    srv = start_server(mlx_openai_server_cmd, env={"TMPDIR": str(tmp_path)})
    stock = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(tmp_path / "stock"),
                         env={"KVPLUGIN_DISABLE": "1"})  # fresh, as ours: the same history
    one = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]
    two = [{"role": "user", "content": "Describe the market on a rainy day."}]

    def turn(server, messages):
        response = server.chat(messages, max_tokens=8)
        messages.append({"role": "assistant", "content": answer_text(response)})
        return answer_text(response), cached_tokens(response)

    ours, theirs = [], []
    for server, out in ((srv, ours), (stock, theirs)):
        a, b = [dict(m) for m in one], [dict(m) for m in two]
        out.append(turn(server, a))
        out.append(turn(server, b))  # a's entry leaves memory before b's prefill
        a.append({"role": "user", "content": "Where does he live?"})
        out.append(turn(server, a))  # a, from its file
        a.append({"role": "user", "content": "And in winter?"})
        out.append(turn(server, a))  # a again, straight after: from memory
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert all(o[1] >= t[1] for o, t in zip(ours, theirs)), (ours, theirs)
    assert ours[2][1] > 0 and ours[3][1] > 0, ours
    stats = srv.get("/kvplugin/stats")
    assert stats["store_cold_hits"] >= 1 and stats["store_hits"] >= 2, stats
    assert stats["store_entries"] <= 1 and stats["store_spills"] >= 2, stats
    tiers = list(tmp_path.glob("kvplugin-oai-prompt-cache-*"))
    assert len(tiers) == 1 and any(tiers[0].rglob("*.safetensors")), tiers
    os.killpg(srv.pid, signal.SIGINT)  # a user's Ctrl-C: the host's orderly shut-down
    srv.proc.wait(timeout=60)
    assert not tiers[0].exists(), "the private directory outlived the server"


def test_max_bytes_bounds_the_entry_files(start_server):
    budget = 50_000  # two of these short conversations' entry files
    srv = start_server(mlx_openai_server_cmd, "--max-bytes", str(budget))
    for text in (*TURNS, *OTHER):
        conversation(srv, (text,), max_tokens=4)
    stats = srv.get("/kvplugin/stats")
    assert 0 < stats["cold_disk_bytes"] <= budget, {
        k: v for k, v in stats.items() if k.startswith(("cold_", "store_"))}
    assert stats["cold_evictions"] >= 1 and stats["store_entries"] <= 1, str({
        k: v for k, v in stats.items() if k.startswith(("cold_", "store_"))})


def test_hot_cache_only_keeps_entries_in_memory_within_max_bytes(start_server):
    budget = 100_000
    srv = start_server(mlx_openai_server_cmd, "--max-bytes", str(budget), "--hot-cache-only")
    for text in (*TURNS, *OTHER):
        conversation(srv, (text,), max_tokens=4)
    stats = srv.get("/kvplugin/stats")
    assert 0 < stats["store_bytes"] <= budget, stats
    assert stats["store_evictions"] >= 1 and stats["cold_tier"] is None, stats

@pytest.mark.parametrize("path", ["batched", "single"])
def test_pressure_keeps_the_conversation_in_progress_full_precision(start_server, tmp_path,
                                                                    path):
    """With ``--kv-cache-quantization-policy pressure`` the conversation that just ended is
    held at full precision (its next turn restores nothing and answers as stock's fp16), and
    what is written out is quantized."""
    extra = ["--disable-batching"] if path == "single" else []
    srv = start_server(mlx_openai_server_cmd, *extra, "--prompt-cache-dir", str(tmp_path / "q"),
                       env={"KVPLUGIN_KV_CACHE_QUANTIZATION_POLICY": "pressure",
                            "KVPLUGIN_KV_CACHE_MIN_QUANTIZE_TOKENS": "0"})
    stock = start_server(mlx_openai_server_cmd, *extra, "--prompt-cache-dir",
                         str(tmp_path / "stock"), env={"KVPLUGIN_DISABLE": "1"})
    system = {"role": "system", "content": "The town keeps its old clock running. " * 40}

    def chat(server, texts):
        messages, out = [dict(system)], []
        for text in texts:
            messages.append({"role": "user", "content": text})
            out.append(answer_text(server.chat(messages, max_tokens=8)))
            messages.append({"role": "assistant", "content": out[-1]})
        return out

    turns = ("Tell me about the clock tower.", "Who winds it?", "How often?")
    assert chat(srv, turns) == chat(stock, turns)
    chat(srv, OTHER[:1])  # writes the first conversation out
    stats = srv.get("/kvplugin/stats")
    assert stats["hits_full"] >= 2 and stats["hits_demoted"] == 0, stats
    assert stats["store_spills"] >= 1, stats
    assert 0 < stats["cold_disk_bytes"] < 0.6 * stats["store_bytes"], stats  # 8-bit files
