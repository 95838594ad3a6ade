"""A ``--ssd-cache-dir`` that cannot be used stops ``vllm-mlx serve`` before it listens, in
default (simple) mode and under ``--continuous-batching`` alike: exit 2, naming the flag and
``KVPLUGIN_SSD_CACHE_DIR`` (it used to serve stock in one mode and fail with a traceback in
the other). A read-only one (a read-only mount, no write permission) is served read-only and
said so."""

from __future__ import annotations

import faults
import harness
import pytest

VAR = "KVPLUGIN_SSD_CACHE_DIR"
MODES = {"simple": (), "batching": ("--continuous-batching",)}


# every way the directory is unusable in both modes, once as the flag, once from the env
@pytest.mark.parametrize("kind, mode, by", [
    ("cannot-be-created", "simple", "flag"), ("cannot-be-created", "batching", "env"),
    ("a-file", "simple", "env"), ("a-file", "batching", "flag"),
    ("unreadable", "simple", "flag"), ("unreadable", "batching", "env"),
])
def test_an_unusable_ssd_dir_stops_the_start(tiny_model, tmp_path, kind, mode, by):
    path, wrap = harness.unusable_ssd_dir(kind, tmp_path)
    port = harness.free_port()
    extra, env = (("--ssd-cache-dir", path), None) if by == "flag" else ((), {VAR: path})
    result, accepted = harness.failed_start(
        wrap(harness.vllm_mlx_serve_cmd(tiny_model, port, *MODES[mode], *extra)), port,
        env=env)
    given = f"--ssd-cache-dir '{path}'" if by == "flag" else f"{VAR}='{path}'"
    harness.assert_refused_ssd_dir(result, accepted, given)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("mode, how", [("simple", "no-write-permission"),
                                       ("batching", "read-only-mount")])
def test_a_read_only_ssd_dir_is_served_read_only(tiny_model, tmp_path, mode, how):
    ssd = tmp_path / "kv"
    ssd.mkdir()
    port = harness.free_port()
    cmd = harness.vllm_mlx_serve_cmd(tiny_model, port, *MODES[mode], "--ssd-cache-dir", str(ssd))
    if how == "no-write-permission":
        ssd.chmod(0o555)
        serve = _serve_read_only(harness.as_plain_user(cmd), port, tmp_path)
    else:
        with faults.read_only(ssd):
            serve = _serve_read_only(cmd, port, tmp_path)
    said = [ln for ln in serve["log"].splitlines() if "read-only" in ln and str(ssd) in ln]
    assert len(said) == 1 and said[0].startswith("kvplugin: "), serve["log"][-3000:]
    assert serve["mode"] == {"simple": "simple", "batching": "continuous-batching"}[mode]
    assert serve["cold_tier"] is not None and serve["cold_tier"]["puts"] == 0, serve


def _serve_read_only(cmd: list[str], port: int, tmp_path) -> dict:
    """Start, answer one request, return the log and the stats' mode and cold tier."""
    with harness.ServerProcess(cmd, port=port, model=harness.SERVED_MODEL_NAME,
                               workdir=tmp_path / "server").start() as srv:
        assert harness.answer_text(srv.chat("Tell me about the bridge.", max_tokens=4))
        stats = srv.get("/kvplugin/stats")
        return {"log": srv.log_text(), "mode": stats.get("mode"),
                "cold_tier": stats.get("cold_tier")}
