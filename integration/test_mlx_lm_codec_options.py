"""A codec the model's cache cannot take stops ``mlx_lm.server`` before it listens, naming
the flag and the variable: a user's named codec is never stored as another one."""

from __future__ import annotations

import json
import shutil

import harness
import pytest
from harness import run_command

from kvplugin.settings import option_info


@pytest.mark.parametrize("by", ["flag", "env"])
def test_a_codec_the_head_dimension_cannot_take_stops_the_server(tiny_model, tmp_path, by):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["head_dim"] = 96  # no Hadamard of this width (decided from config.json, before weights)
    (model / "config.json").write_text(json.dumps(cfg))
    info = option_info("kv_cache_codec")
    group = ("--kv-cache-quantization-group-size", "32")
    if by == "flag":
        extra, env = (*group, info.flag, "rotated-channel"), None
    else:
        extra, env = group, {info.env: "rotated-channel"}
    r = run_command(harness.mlx_lm_server_cmd(model, harness.free_port(), *extra), env=env,
                    timeout=90)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert info.flag in r.stderr and info.env in r.stderr, r.stderr[-2000:]
    assert "can only take affine" in r.stderr, r.stderr[-2000:]
    assert "Starting httpd" not in r.stderr + r.stdout


@pytest.mark.parametrize("state", ["default", "off"])
def test_recurrent_state_is_stored_quantized_unless_switched_off(start_server, tmp_path, state):
    """Mamba's entries hold recurrent state only: quantized (rotated, 8 bits) by default, at
    full precision with ``--no-kv-cache-quantize-state``, the same answer either way."""
    from kvplugin.tools.models.families import build_family_model

    model = build_family_model("mamba", tmp_path / "model")
    flags = ["--kv-cache-quantization", "--kv-cache-min-quantize-tokens", "0"]
    if state == "off":
        flags.append("--no-kv-cache-quantize-state")
    srv = start_server(harness.mlx_lm_server_cmd, *flags, model_dir=model)
    prompt = "Tell me about rivers and the hills above them. " * 8
    first = srv.chat(prompt, max_tokens=6)
    again = srv.chat(prompt, max_tokens=6)  # a hit on the stored entry
    stats = srv.get("/kvplugin/stats")
    srv.stop()
    assert harness.answer_text(first) == harness.answer_text(again)
    assert stats["store_hits"] >= 1, stats
    codecs = set(stats["bytes_stored_by_codec"])
    if state == "off":
        assert stats["entries_quantized"] == 0 and codecs == {"full"}, stats
    else:
        assert stats["entries_quantized"] >= 1 and codecs == {"rotated-state-8bit"}, stats
        assert stats["bytes_stored"] * 1.8 <= stats["bytes_before"], stats
