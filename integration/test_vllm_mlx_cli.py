"""``vllm-mlx serve`` command line with kvplugin: options, env variables, start-up errors.

Real ``vllm-mlx`` processes (no server needs to come up for most of these: they exit early).
"""

from __future__ import annotations

import re

import harness
import pytest
from harness import run_command, vllm_mlx_serve_cmd

ADOPTED = {
    "--kv-cache-quantization": "KVPLUGIN_KV_CACHE_QUANTIZATION",
    "--kv-cache-quantization-bits": "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS",
    "--kv-cache-quantization-group-size": "KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE",
    "--kv-cache-min-quantize-tokens": "KVPLUGIN_KV_CACHE_MIN_QUANTIZE_TOKENS",
    "--max-kv-size": "KVPLUGIN_MAX_KV_SIZE",
    "--ssd-cache-dir": "KVPLUGIN_SSD_CACHE_DIR",
    "--ssd-cache-max-gb": "KVPLUGIN_SSD_CACHE_MAX_GB",
}
ADDED = {
    "--hot-cache-only": "KVPLUGIN_HOT_CACHE_ONLY",
    "--kv-cache-step": "KVPLUGIN_KV_CACHE_STEP",
}


def vllm_mlx():
    return str(harness.venv_script("vllm-mlx"))


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _help_entries(text: str) -> dict[str, str]:
    """``{first flag: its whole help entry, whitespace-flattened}`` of an argparse help."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current is not None and line.startswith("      "):
            entries[current] += " " + line
        else:
            current = None
    return {k: _flat(v) for k, v in entries.items()}


def test_vllm_mlx_is_installed():
    assert harness.host_version("vllm-mlx") in ("0.5.0", "0.6.0")


def test_serve_help_names_every_option_and_variable():
    out = run_command([vllm_mlx(), "serve", "--help"], timeout=120)
    assert out.returncode == 0, out.stderr
    entries = _help_entries(out.stdout)
    for flag, env in {**ADOPTED, **ADDED}.items():
        assert flag in entries, flag
        assert f"[env: {env}]" in entries[flag], (flag, entries[flag])
    # bits widened from vllm-mlx's [4, 8]
    assert "Allowed: 2, 3, 4, 5, 6, 8" in entries["--kv-cache-quantization-bits"]
    assert out.stderr.count("kvplugin:") == 0, out.stderr  # nothing to say when all is well


def test_disabled_is_stock_with_one_line():
    out = run_command(
        [vllm_mlx(), "serve", "--help"], env={"KVPLUGIN_DISABLE": "1"}, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--hot-cache-only" not in out.stdout
    assert "KVPLUGIN_" not in out.stdout
    assert "{4,8}" in out.stdout.replace(" ", "")  # vllm-mlx's own choices are back
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("kvplugin:")]
    assert len(lines) == 1 and "KVPLUGIN_DISABLE" in lines[0], out.stderr


def _serve(tiny_model, *extra, env=None, timeout=120):
    port = harness.free_port()
    return run_command(vllm_mlx_serve_cmd(tiny_model, port, *extra), env=env, timeout=timeout)


@pytest.mark.parametrize(
    "extra, env",
    [
        (("--kv-cache-quantization", "--kv-cache-quantization-group-size", "128"), None),
        (
            (),
            {
                "KVPLUGIN_KV_CACHE_QUANTIZATION": "1",
                "KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE": "128",
            },
        ),
    ],
    ids=["flag", "env"],
)
def test_group_size_not_dividing_head_dim_stops_the_server(tiny_model, extra, env):
    out = _serve(tiny_model, *extra, env=env)
    assert out.returncode != 0
    err = _flat(out.stderr)
    assert "--kv-cache-quantization-group-size" in err, out.stderr
    assert "KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE" in err, out.stderr
    assert "head dimension 64" in err, out.stderr
    assert "Uvicorn running" not in out.stdout + out.stderr


@pytest.mark.parametrize(
    "extra, env, needle",
    [
        (("--kv-cache-quantization-bits", "7"), None, "--kv-cache-quantization-bits"),
        ((), {"KVPLUGIN_MAX_KV_SIZE": "-5"}, "KVPLUGIN_MAX_KV_SIZE"),
    ],
    ids=["bits-flag", "max-kv-env"],
)
def test_bad_values_exit_2_before_loading(tiny_model, extra, env, needle):
    out = _serve(tiny_model, *extra, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert needle in out.stderr, out.stderr
    assert "Loading model" not in out.stdout


def test_hot_cache_only_wins_over_an_ssd_dir(start_server, tmp_path):
    # Was the "hot-only-vs-ssd" case of test_bad_values_exit_2_before_loading: since the
    # settings let --hot-cache-only win over an SSD directory (one notice, no error), the
    # server starts, says so once, and writes nothing to that directory.
    ssd = tmp_path / "ssd"
    srv = start_server(vllm_mlx_serve_cmd, "--hot-cache-only", "--ssd-cache-dir", str(ssd))
    answer = srv.chat("Tell me about the bridge.", max_tokens=4)
    assert answer["choices"][0]["message"]["content"] is not None
    lines = [ln for ln in srv.log_text().splitlines() if "--hot-cache-only wins" in ln]
    assert len(lines) == 1 and str(ssd) in lines[0], srv.log_tail()
    srv.stop()
    assert not ssd.exists() or not any(ssd.rglob("*"))


def test_unsupported_mode_is_announced_in_one_line(start_server):
    srv = start_server(
        vllm_mlx_serve_cmd, "--continuous-batching", "--use-paged-cache", "--kv-cache-quantization"
    )
    answer = srv.chat("Tell me about the bridge.", max_tokens=4)
    assert answer["choices"][0]["message"]["content"] is not None
    lines = [ln for ln in srv.log_text().splitlines() if ln.startswith("kvplugin: not applied")]
    assert len(lines) == 1, srv.log_tail()
    assert "--use-paged-cache" in lines[0] and "--kv-cache-quantization" in lines[0]


def test_plugin_refusing_the_configuration_stops_the_server(tiny_model, refusing_plugin):
    # vllm-mlx used to swallow this and serve stock; it must stop like mlx-lm does
    out = _serve(tiny_model, env=refusing_plugin)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "kvp-refuse: refusing to serve on vllm-mlx" in out.stderr, out.stderr[-2000:]
    assert "Uvicorn running" not in out.stdout + out.stderr
