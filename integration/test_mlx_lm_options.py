"""kvplugin's options on ``mlx_lm.server``: listed in ``--help`` with their env variables,
validated at start-up (flag and env), and absent when ``KVPLUGIN_DISABLE=1``."""

from __future__ import annotations

import sys

import harness
import pytest
from harness import run_command

from kvplugin.settings import option_info, option_infos


def _help(*launcher: str, env=None):
    r = run_command([*launcher, "--help"], env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _script() -> str:
    return str(harness.venv_script("mlx_lm.server"))


def test_help_lists_every_option_with_its_env_variable():
    out = _help(_script())
    for info in option_infos():
        assert info.flag in out, info.flag
        assert info.env in out, info.env
    assert "kvplugin (KV-cache memory" in out
    assert "--prompt-cache-bytes" in out  # the host's own options are still there
    # how mlx-lm's own --kv-bits relates to kvplugin's quantization is said where both show
    note = " ".join(out.split())
    assert "How these relate to mlx-lm's --kv-bits" in note and "STORES between requests" in note


def test_help_via_python_m_mlx_lm_server():
    harness.host_version("mlx-lm")
    out = _help(sys.executable, "-m", "mlx_lm", "server")
    assert "--max-kv-size" in out and "KVPLUGIN_MAX_KV_SIZE" in out


def test_disabled_help_is_stock():
    r = run_command([_script(), "--help"], env={"KVPLUGIN_DISABLE": "1"}, timeout=60)
    assert r.returncode == 0
    assert "KVPLUGIN_" not in r.stdout and "--max-kv-size" not in r.stdout
    assert "kvplugin: disabled by KVPLUGIN_DISABLE" in r.stderr


def _start_fails(tiny_model, *extra, env=None):
    port = harness.free_port()
    r = run_command(harness.mlx_lm_server_cmd(tiny_model, port, *extra), env=env, timeout=90)
    assert r.returncode != 0, (r.stdout, r.stderr)
    return r


@pytest.mark.parametrize(
    "field, extra, env, got",
    [
        ("kv_cache_quantization_bits", ("--kv-cache-quantization-bits", "7"), None,
         "--kv-cache-quantization-bits 7"),
        ("kv_cache_quantization_bits", (), {"KVPLUGIN_KV_CACHE_QUANTIZATION_BITS": "7"},
         "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS='7'"),
        ("max_kv_size", ("--max-kv-size", "0"), None, "--max-kv-size 0"),
        ("kv_cache_step", (), {"KVPLUGIN_KV_CACHE_STEP": "-3"}, "KVPLUGIN_KV_CACHE_STEP='-3'"),
        ("kv_cache_quantization_policy", ("--kv-cache-quantization-policy", "lazy"), None,
         "--kv-cache-quantization-policy 'lazy'"),
        ("kv_cache_quantization_policy", (), {"KVPLUGIN_KV_CACHE_QUANTIZATION_POLICY": "lazy"},
         "KVPLUGIN_KV_CACHE_QUANTIZATION_POLICY='lazy'"),
    ],
    ids=["bits-flag", "bits-env", "max-kv-size-flag", "step-env", "policy-flag", "policy-env"],
)
def test_bad_value_stops_the_server(tiny_model, field, extra, env, got):
    r = _start_fails(tiny_model, *extra, env=env)
    assert r.returncode == 2
    info = option_info(field)
    assert info.flag in r.stderr and info.env in r.stderr, r.stderr
    assert got in r.stderr, r.stderr


@pytest.mark.parametrize("by", ["flag", "env"])
def test_group_size_not_dividing_head_dim_stops_the_server(tiny_model, by):
    # the tiny model's head dimension is 64: group 128 cannot quantize it
    info = option_info("kv_cache_quantization_group_size")
    if by == "flag":
        r = _start_fails(tiny_model, "--kv-cache-quantization", info.flag, "128")
        assert f"got {info.flag} 128" in r.stderr, r.stderr
    else:
        r = _start_fails(tiny_model, env={"KVPLUGIN_KV_CACHE_QUANTIZATION": "1", info.env: "128"})
        assert f"got {info.env}=128" in r.stderr, r.stderr
    assert r.returncode == 2
    assert info.flag in r.stderr and info.env in r.stderr
    assert "head dimension 64" in r.stderr
    # decided from config.json before the server listens (it used to come after the weights
    # loaded in the generation thread, with the port already open)
    assert "Starting httpd" not in r.stderr + r.stdout


@pytest.mark.host_version("mlx-lm", ">=0.32.0")  # --kv-bits is a server flag from 0.32 on
def test_max_kv_size_with_mlx_lm_kv_bits_is_refused(tiny_model):
    r = _start_fails(tiny_model, "--max-kv-size", "64", "--kv-bits", "8")
    assert r.returncode == 2
    assert "--max-kv-size" in r.stderr and "--kv-bits" in r.stderr


def test_plugin_refusing_the_configuration_stops_the_server(tiny_model, refusing_plugin):
    r = _start_fails(tiny_model, env=refusing_plugin)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "kvp-refuse: refusing to serve on mlx-lm" in r.stderr, r.stderr[-2000:]
