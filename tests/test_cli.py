"""The ``kvplugin`` command line: help, ``info``, ``demo`` and ``bench`` argument handling.

Fast: nothing here starts a server or imports mlx (the real runs are in
``integration/test_mlx_lm_demo.py``).
"""

from __future__ import annotations

import io
import sys
import types

import pytest

from kvplugin import cli
from kvplugin.settings import option_infos
from kvplugin.tools import demo, hostcmd


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


# --------------------------------------------------------------------------- help


def test_help_lists_every_command(capsys):
    code, out, _ = _exit_code(["--help"], capsys)
    assert code == 0
    for command in ("info", "demo", "bench"):
        assert command in out


def test_version(capsys):
    import kvplugin

    code, out, _ = _exit_code(["--version"], capsys)
    assert code == 0 and kvplugin.__version__ in out


def test_demo_help(capsys):
    code, out, _ = _exit_code(["demo", "--help"], capsys)
    assert code == 0
    for text in ("--host", "mlx-lm", "vllm-mlx", "--bits", "--prompt-cache-bytes", "--turns",
                 "--model-dir", "--json", "-- HOST_ARGS"):
        assert text in out, text


def test_bench_help_shows_modes_and_engine_options(capsys):
    code, out, _ = _exit_code(["bench", "--help"], capsys)
    assert code == 0
    assert "--server" in out and "--quality" in out
    assert "engine-level options" in out and "--tokens" in out  # the engine bench's own help


def test_bench_server_help(capsys):
    code, out, _ = _exit_code(["bench", "--server", "--help"], capsys)
    assert code == 0
    for text in ("--host", "--quick", "--out", "--fit-budget", "--decode-tokens", "--sizes"):
        assert text in out, text


# --------------------------------------------------------------------------- info


def test_info_lists_hosts_plugins_and_settings_with_sources(capsys, monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_STEP", "512")
    rc = cli.main(["info", "--max-kv-size", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    # (the heading said "flag > env > default" before the configuration file existed)
    assert "hosts:" in out and "plugins:" in out and "settings (flag > env > file > default):" in out
    assert "mlx-lm" in out and "vllm-mlx" in out and "supported range" in out
    assert "builtin" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  --")}
    for info in option_infos():
        assert info.flag in rows, info.flag
        assert info.env in rows[info.flag]
    assert "4096" in rows["--max-kv-size"] and "[flag]" in rows["--max-kv-size"]
    assert "512" in rows["--kv-cache-step"] and "[env]" in rows["--kv-cache-step"]
    assert "[default]" in rows["--hot-cache-only"]


def test_info_tells_active_disabled_and_missing_activation(capsys, monkeypatch):
    from kvplugin import info

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "status: active" in out and "kvplugin.pth" in out
    monkeypatch.setenv("KVPLUGIN_DISABLE", "1")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "status: disabled" in out and "KVPLUGIN_DISABLE='1'" in out
    monkeypatch.delenv("KVPLUGIN_DISABLE")
    monkeypatch.setattr(info, "_site_dirs", lambda: [])
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "status: inactive" in out and "activation file: MISSING" in out


def test_info_json_has_the_same_facts(capsys, monkeypatch, tmp_path):
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvplugin.toml").write_text("max_kv_size = 2048\n")
    monkeypatch.setenv("KVPLUGIN_HOME", str(tmp_path / "home"))
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["activation"]["state"] == "active"
    assert data["config_file"] == str(tmp_path / "kvplugin.toml")
    assert data["model_cache"] == str(tmp_path / "home")
    row = next(r for r in data["settings"] if r["flag"] == "--max-kv-size")
    assert row["value"] == 2048 and row["source"] == "file"
    assert {h["name"] for h in data["hosts"]} >= {"mlx-lm", "vllm-mlx"}


def test_info_ends_cleanly_on_a_closed_pipe():
    """``kvplugin info | head``: the reader is gone before info writes; no traceback."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGIN_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvplugin.cli", "info"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the first line (head -0)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()  # the closed pipe was met, and handled
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()


def test_info_lists_hosts_found_through_entry_points(capsys):
    from kvplugin.hosts import adapter_paths

    rc = cli.main(["info"])
    out = capsys.readouterr().out
    assert rc == 0
    for name in adapter_paths():
        assert f"  {name} " in out


def test_info_bad_value_exits_2_naming_flag_and_env(capsys):
    try:
        rc = cli.main(["info", "--kv-cache-quantization-bits", "9"])
    except SystemExit as exc:  # argparse-level validation
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert "--kv-cache-quantization-bits" in err and "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["info", "--bogus"], "unrecognized arguments: --bogus"),
        (["nosuch"], "invalid choice"),
        (["demo", "--bits", "9"], "argument --bits: invalid choice"),
        (["demo", "--host", "ollama"], "argument --host: invalid choice"),
        (["demo", "--turns", "1"], "argument --turns: invalid choice"),
        (["demo", "--prompt-cache-bytes", "lots"], "argument --prompt-cache-bytes"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["bench", "--server", "--quality"], "not allowed with argument"),
        (["bench", "--server", "--sizes", "1,x"], "argument --sizes"),
        (["bench", "--server", "--kv-bits", "1"], "argument --kv-bits: invalid choice"),
    ],
)
def test_bad_options_exit_2_with_a_message(capsys, argv, message):
    code, _, err = _exit_code(argv, capsys)
    assert code == 2
    assert message in err


# --------------------------------------------------------------------------- demo


def test_demo_host_args_after_double_dash():
    args, rest = cli.build_parser().parse_known_args(
        ["demo", "--bits", "4", "--", "--max-kv-size", "512", "--hot-cache-only"])
    assert rest == []
    assert args.bits == 4
    assert args.host_args == ["--max-kv-size", "512", "--hot-cache-only"]
    assert args.host == "mlx-lm" and args.turns == 4


@pytest.mark.parametrize("text, value", [("64M", 64 << 20), ("1G", 1 << 30), ("500000", 500000),
                                         ("1.5k", 1536), ("8MiB", 8 << 20)])
def test_size_argument(text, value):
    assert demo._size(text) == value


def test_demo_missing_host_fails_clearly(capsys, monkeypatch):
    def missing(dist):
        raise hostcmd.HostNotInstalled(f"distribution {dist!r} is not installed")

    monkeypatch.setattr(hostcmd, "host_version", missing)
    rc = cli.main(["demo", "--host", "vllm-mlx", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "vllm-mlx is not installed" in err and "pip install" in err


def test_demo_unsupported_host_version_fails_clearly(capsys, monkeypatch):
    monkeypatch.setattr(hostcmd, "host_version", lambda dist: "0.1.0")
    rc = cli.main(["demo", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "mlx-lm 0.1.0 is installed" in err and "would run stock" in err


def test_demo_refuses_when_kvplugin_is_disabled(capsys, monkeypatch):
    monkeypatch.setattr(demo.HostSpec, "check", lambda self: "0.32.2")
    monkeypatch.setenv("KVPLUGIN_DISABLE", "1")
    rc = cli.main(["demo", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "KVPLUGIN_DISABLE" in err


def test_demo_interrupt_exits_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    rc = cli.main(["demo", "--no-progress"])
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err


def test_status_lines_without_a_terminal():
    buf = io.StringIO()
    with demo.Status("starting the server", stream=buf):
        pass
    with pytest.raises(RuntimeError):
        with demo.Status("holding a conversation", stream=buf):
            raise RuntimeError("boom")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "kvplugin: starting the server ..."
    assert lines[1].startswith("kvplugin: starting the server: done (")
    assert lines[3].startswith("kvplugin: holding a conversation: failed (")


def test_host_specs():
    mlx = demo.host_spec("mlx-lm")
    assert mlx.model is None
    assert mlx.budget_args(8 << 20) == ["--prompt-cache-bytes", str(8 << 20),
                                        "--prompt-cache-size", "1000"]
    vllm = demo.host_spec("vllm-mlx")
    assert vllm.model == hostcmd.SERVED_MODEL_NAME
    assert vllm.budget_args(8 << 20)[0] == "--cache-memory-mb"
    assert vllm.env["VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION"] == "wait"


# --------------------------------------------------------------------------- bench


@pytest.fixture
def calls(monkeypatch):
    """Replace the three benchmarks' ``main`` and record the argv each gets."""
    from kvplugin.tools.bench import engine, server

    seen: list[tuple[str, list[str]]] = []

    def fake(name):
        def main(argv=None):
            seen.append((name, list(argv)))
            return 0
        return main

    monkeypatch.setattr(engine, "main", fake("engine"))
    monkeypatch.setattr(server, "main", fake("server"))
    quality = types.ModuleType("kvplugin.tools.bench.quality")
    quality.main = fake("quality")
    monkeypatch.setitem(sys.modules, "kvplugin.tools.bench.quality", quality)
    return seen


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench"], ("engine", [])),
        (["bench", "--quick", "--tokens", "64", "--out", "o"],
         ("engine", ["--quick", "--tokens", "64", "--out", "o"])),
        (["bench", "--server", "--quick", "--out", "o"], ("server", ["--quick", "--out", "o"])),
        (["bench", "--quick", "--server"], ("server", ["--quick"])),
        (["bench", "--server", "--quick", "--", "--max-kv-size", "64"],
         ("server", ["--quick", "--", "--max-kv-size", "64"])),
        (["bench", "--quality", "--bits", "8"], ("quality", ["--bits", "8"])),
        (["bench", "--server", "-h"], ("server", ["--help"])),
    ],
)
def test_bench_forwards_arguments(calls, argv, expected):
    assert cli.main(argv) == 0
    assert calls == [expected]


def test_bench_quality_missing_module(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvplugin.tools.bench.quality", None)
    rc = cli.main(["bench", "--quality"])
    assert rc == 2
    assert "quality benchmark is not part of this kvplugin build" in capsys.readouterr().err


def test_server_bench_quick_and_default_sizes():
    from kvplugin.tools.bench import server

    quick = server._resolve(server.build_parser().parse_args(["--quick"]))
    default = server._resolve(server.build_parser().parse_args([]))
    assert quick.sizes == server.QUICK["sizes"] and quick.fit_budget == server.QUICK["fit_budget"]
    assert default.sizes == [1024, 2048]  # the TTFT goal is stated at 2k tokens
    assert default.decode_tokens == 128
    custom = server._resolve(server.build_parser().parse_args(
        ["--quick", "--sizes", "300,600", "--fit-budget", "2M", "--", "--max-kv-size", "4096"]))
    assert custom.sizes == [300, 600] and custom.fit_budget == 2 << 20
    assert custom.host_args == ["--max-kv-size", "4096"]


def _fake_result(quick: bool = False) -> dict:
    """A server-bench result with the shape ``run`` returns (numbers made up)."""
    def ttft(cold, warm):
        row = {"prefix_tokens": 2048}
        for how in ("stream", "one_token"):
            row.update({f"{how}_cold_s": cold, f"{how}_warm_s": warm,
                        f"{how}_speedup": cold / warm, f"{how}_cold_cached_tokens": 4,
                        f"{how}_warm_cached_tokens": 2070, f"{how}_cold_prompt_tokens": 2060,
                        f"{how}_warm_prompt_tokens": 2080})
        return {"2048": row}

    def memory(end, store=None):
        m = {"conversations": 4, "turns": 6, "prefix_tokens": 2048, "max_tokens": 32,
             "rss_start": 100 << 20, "rss_after_cold": 130 << 20, "rss_end": end,
             "rss_peak": end + (1 << 20), "rss_reuse_peak": end, "t_after_cold": 3.0,
             "rss_growth": end - (100 << 20), "rss_peak_growth": end - (99 << 20),
             "rss_reuse_growth": end - (130 << 20), "rss_reuse_peak_growth": 1 << 20,
             "requests": [{"t_start": 0.0, "t_end": 1.0, "rss_peak": end, "store_bytes": store}],
             "series": [(0.0, 100 << 20), (1.0, end)], "vm_hwm": end}
        if store is not None:
            m.update(store_bytes=store, store_bytes_start=0, store_growth=store)
        return m

    def fit(held, entry=None, dense=None):
        f = {"budget_bytes": 8 << 20, "prefix_tokens": 512, "max_tried": 32,
             "conversations_held": held, "saturated": False,
             "bytes_per_conversation": (8 << 20) / held, "rounds": []}
        if entry is not None:
            f.update(entry_bytes_mean=entry, entry_dense_bytes_mean=dense)
        return f

    def decode(tps):
        return {"decode_tps": tps, "decode_tps_best": tps * 1.1,
                "e2e_tps": tps * 0.8, "e2e_tps_best": tps * 0.9, "tokens_per_cpu_s": tps * 0.7,
                "completion_tokens": 128, "samples": []}

    def quart(m):
        return {"q1": m - 0.03, "median": m, "q3": m + 0.03, "n": 12}

    return {
        "decode_paired": {"cpu": quart(0.99), "end_to_end": quart(0.97),
                          "first_last": quart(1.01)},
        "config": {"host": "mlx-lm", "host_version": "0.32.2", "quick": quick, "sizes": [2048],
                   "repeats": 3, "decode_rounds": 12, "decode_tokens": 128, "kv_bits": 8},
        "environment": {},
        "stock": {"ttft": ttft(3.0, 0.09), "memory": memory(150 << 20), "fit": fit(16),
                  "decode": decode(500.0)},
        "kvplugin": {"ttft": ttft(3.0, 0.12), "memory": memory(140 << 20, 5 << 20),
                     "fit": fit(29, 274 << 10, 517 << 10), "decode": decode(495.0)},
    }


def test_server_bench_ratios_goals_and_tables():
    from kvplugin.tools.bench import server

    res = _fake_result()
    res["ratios"] = server.ratios(res)
    goals = {g.name: g for g in server.goals(res)}
    assert goals["warm TTFT speed-up at 2048 tokens"].met is True  # 25x >= 10x
    assert goals["decode throughput kvplugin / stock"].met is True  # 0.99x >= 0.98x
    assert goals["8-bit stored / fp16 bytes (server entries)"].met is True  # 0.530 <= 0.532
    assert res["ratios"]["fit"]["conversations_held_kvplugin_over_stock"] == pytest.approx(29 / 16)
    text = server.tables(res)
    for heading in ("time to first token", "memory across reuse", "conversations held",
                    "decode throughput"):
        assert heading in text
    # the goal is judged on the per-round ratio of server CPU time (immune to other processes)
    res["decode_paired"]["cpu"] = {"q1": 0.9, "median": 0.95, "q3": 1.0, "n": 12}
    res["ratios"] = server.ratios(res)
    goal = {g.name: g for g in server.goals(res)}["decode throughput kvplugin / stock"]
    assert goal.met is False and goal.value == pytest.approx(0.95)
    assert "CPU-seconds" in goal.note and "0.900-1.000" in goal.note
    # ... and on the per-round wall-clock ratio where the system has no /proc
    res["decode_paired"]["cpu"] = {"q1": None, "median": None, "q3": None, "n": 0}
    res["ratios"] = server.ratios(res)
    goal = {g.name: g for g in server.goals(res)}["decode throughput kvplugin / stock"]
    assert goal.met is False and goal.value == pytest.approx(0.97)
    assert "stock time / kvplugin time" in goal.note


def test_info_says_what_the_auto_codec_resolves_to(capsys):
    assert cli.main(["info", "--kv-cache-quantization-bits", "4"]) == 0
    assert "stored entries' codec (resolved): rotated-channel-k4v4-s4r16" in capsys.readouterr().out
    assert cli.main(["info"]) == 0  # quantization off: no codec line
    assert "codec (resolved)" not in capsys.readouterr().out
