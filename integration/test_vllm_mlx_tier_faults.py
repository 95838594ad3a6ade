"""Entries that do not fit the model, from ``--ssd-cache-dir``, behind real ``vllm-mlx serve``
processes (default mode and ``--continuous-batching``): never served, counted, answers as
without them, and the server keeps serving.

A first server (continuous batching, one sequence at a time) answers a conversation (a miss:
what stock answers) and spills it at shut-down; its entries are then narrowed to head_dim 32
(the tiny model's is 64) with a valid digest, and a server of each mode is started on a copy.
"""

from __future__ import annotations

import shutil

import faults
import harness
from harness import answer_text, vllm_mlx_serve_cmd
from vllm_workload import SYSTEM

CB = ("--continuous-batching", "--prefill-batch-size", "1", "--completion-batch-size", "1")
HISTORY = [SYSTEM, {"role": "user", "content": "Visitor 3 asks: what about bed 21?"}]


def _start(tiny_model, workdir, ssd, *extra):
    port = harness.free_port()
    return harness.ServerProcess(
        vllm_mlx_serve_cmd(tiny_model, port, "--ssd-cache-dir", str(ssd), *extra), port=port,
        model=harness.SERVED_MODEL_NAME, workdir=workdir).start()


def test_narrowed_entries_are_refused_in_both_modes(tiny_model, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("vllm-faults") / "kv"
    first = _start(tiny_model, tmp_path_factory.mktemp("writer"), ssd, *CB)
    try:
        want = answer_text(first.chat(HISTORY, max_tokens=10))
    finally:
        first.stop()  # spills its hot entries to --ssd-cache-dir
    files = faults.entry_files(ssd)
    assert files and faults.narrow_entries(files, 32) == len(files)
    copy = ssd.parent / "kv-copy"
    shutil.copytree(ssd, copy)
    for directory, extra in ((ssd, ()), (copy, (*CB, "--enable-metrics"))):
        srv = _start(tiny_model, tmp_path_factory.mktemp("reader"), directory, *extra)
        try:
            stats = srv.get("/kvplugin/stats")
            assert stats["store_cold_entries"] == len(files), stats
            got = srv.chat(HISTORY, max_tokens=10)
            assert answer_text(got) == want, extra
            stats = srv.get("/kvplugin/stats")
            assert stats["entries_invalid"] >= 1 and stats["store_cold_hits"] == 0, stats
            assert answer_text(srv.chat(HISTORY, max_tokens=10)) == want  # still serving
            assert "does not fit the model" in srv.log_text()
            if "--enable-metrics" in extra:  # vllm-mlx's own /metrics carries every tier series
                status, text = srv.request("GET", "/metrics")
                assert status == 200, text
                series = {line.split(" ")[0]: float(line.split(" ")[1])
                          for line in str(text).splitlines() if line.startswith("kvplugin_")}
                assert series["kvplugin_entries_invalid_total"] == stats["entries_invalid"]
                assert series["kvplugin_cold_disk_bytes"] > 0, series
                for name in ("corrupt", "refused", "evictions", "puts", "write_failures"):
                    assert f"kvplugin_cold_{name}_total" in series, name
        finally:
            srv.stop()


# how a failed request shows: an error status, or a connection closed without a response
FAILED = (harness.ServerHTTPError, OSError)


def _request_failed(srv: harness.ServerProcess) -> bool:
    """Whether the host failed this request. vllm-mlx 0.6 answers an error status; 0.5's
    continuous-batching scheduler recovers from the generation error itself ("aborted 1
    running requests") and answers 200 with no tokens at all: failed too, in its own way."""
    try:
        reply = srv.chat(HISTORY, max_tokens=10)
    except FAILED:
        return True
    return answer_text(reply) == ""


def test_an_error_while_the_host_uses_an_entry_costs_one_request(tiny_model, tmp_path_factory):
    """An entry that breaks only inside vllm-mlx (a plugin hands it over after every check):
    that request fails, the next ones are served, in both modes."""
    for extra in ((), CB):
        env, trigger = faults.breaking_plugin(tmp_path_factory.mktemp("plugin"))
        port = harness.free_port()
        srv = harness.ServerProcess(vllm_mlx_serve_cmd(tiny_model, port, *extra), port=port,
                                    env=env, model=harness.SERVED_MODEL_NAME,
                                    workdir=tmp_path_factory.mktemp("breaker")).start()
        try:
            want = answer_text(srv.chat(HISTORY, max_tokens=10))
            trigger.touch()
            assert _request_failed(srv), extra
            assert not trigger.exists()
            assert answer_text(srv.chat(HISTORY, max_tokens=10)) == want, extra
            assert answer_text(srv.chat([SYSTEM, {"role": "user", "content": "Hi"}],
                                        max_tokens=4))
        finally:
            srv.stop()
