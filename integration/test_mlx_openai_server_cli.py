"""``mlx-openai-server launch`` command line with kvplugin: options, variables, start-up errors,
``KVPLUGIN_DISABLE``. Real processes; most exit before anything starts."""

from __future__ import annotations

import re

import harness
import pytest
from harness import mlx_openai_server_cmd, run_command

from kvplugin.settings import option_infos


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _launch(tiny_model, *extra, env=None, timeout=180):
    return run_command(mlx_openai_server_cmd(tiny_model, harness.free_port(), *extra),
                       env=env, timeout=timeout)


def test_launch_help_names_every_option_and_variable():
    out = run_command([str(harness.venv_script("mlx-openai-server")), "launch", "--help"])
    assert out.returncode == 0, out.stderr
    text = _flat(out.stdout)
    for info in option_infos():
        assert info.flag in text, info.flag
        assert f"[env: {info.env}]" in text, info.env
    assert "kvplugin:" not in out.stderr, out.stderr  # nothing to say when all is well


@pytest.mark.parametrize(
    "extra, env, needles",
    [
        (("--kv-cache-quantization-bits", "7"), None,
         ("--kv-cache-quantization-bits", "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS")),
        ((), {"KVPLUGIN_MAX_KV_SIZE": "-5"}, ("--max-kv-size", "KVPLUGIN_MAX_KV_SIZE")),
        (("--kv-cache-quantization", "--kv-cache-quantization-group-size", "128"), None,
         ("--kv-cache-quantization-group-size", "KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE",
          "head dimension 64")),
        (("--max-kv-size", "64", "--kv-bits", "8"), None,
         ("--max-kv-size", "KVPLUGIN_MAX_KV_SIZE", "--kv-bits")),
    ],
    ids=["bits-flag", "max-kv-env", "group-vs-head-dim", "max-kv-with-kv-bits"],
)
def test_bad_input_exits_2_before_anything_starts(tiny_model, extra, env, needles):
    out = _launch(tiny_model, *extra, env=env)
    err = _flat(out.stderr)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    for needle in needles:
        assert needle in err, (needle, out.stderr[-2000:])
    assert "Spawning handler process" not in out.stdout + out.stderr
    assert "Uvicorn running" not in out.stdout + out.stderr


def test_an_unusable_prompt_cache_dir_exits_2_naming_it(tiny_model, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    out = _launch(tiny_model, "--prompt-cache-dir", str(a_file / "cannot-be-created"))
    err = _flat(out.stderr)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "--prompt-cache-dir" in err and "KVPLUGIN_SSD_CACHE_DIR" in err, out.stderr[-2000:]
    assert "Uvicorn running" not in out.stdout + out.stderr


def test_disabled_is_stock_said_once_across_both_processes(start_server, tmp_path):
    cache_dir = tmp_path / "stock-cache"
    srv = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(cache_dir),
                       env={"KVPLUGIN_DISABLE": "1"})
    messages = [{"role": "user", "content": "Tell me about the bridge."}]
    first = srv.chat(messages, max_tokens=4)
    messages += [{"role": "assistant", "content": harness.answer_text(first)},
                 {"role": "user", "content": "And the river?"}]
    srv.chat(messages, max_tokens=4)
    status, _ = srv.request("GET", "/kvplugin/stats")
    assert status == 404
    assert list(cache_dir.glob("*.pkl")), "stock's own prompt cache pickles its entries"
    lines = [ln for ln in srv.log_text().splitlines() if ln.startswith("kvplugin:")]
    assert len(lines) == 1 and "KVPLUGIN_DISABLE" in lines[0], lines


def test_a_plugin_refusing_the_configuration_stops_the_server(tiny_model, refusing_plugin):
    out = _launch(tiny_model, env=refusing_plugin)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "kvp-refuse: refusing to serve on mlx-openai-server" in out.stderr, out.stderr[-2000:]
    assert "Uvicorn running" not in out.stdout + out.stderr


def test_an_unsupported_version_is_stock_said_once(start_server, tmp_path):
    # a newer release's metadata first on the path: what `importlib.metadata` then reports
    info = tmp_path / "site" / "mlx_openai_server-1.9.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-openai-server\n"
                                   "Version: 1.9.0\n")
    cache_dir = tmp_path / "stock-cache"
    srv = start_server(mlx_openai_server_cmd, "--prompt-cache-dir", str(cache_dir),
                       env={"PYTHONPATH": str(tmp_path / "site")})
    srv.chat("Tell me about the bridge.", max_tokens=4)
    assert srv.request("GET", "/kvplugin/stats")[0] == 404
    assert list(cache_dir.glob("*.pkl")), "stock's own prompt cache pickles its entries"
    lines = [ln for ln in srv.log_text().splitlines() if ln.startswith("kvplugin:")]
    assert lines == ["kvplugin: mlx-openai-server 1.9.0 is outside kvplugin's supported range "
                     "<1.9,>=1.8.1; mlx-openai-server runs stock"], lines
