"""A ``--ssd-cache-dir`` that cannot be used stops ``mlx_lm.server`` before it listens (exit 2,
naming the flag and ``KVPLUGIN_SSD_CACHE_DIR``), given as a flag, in the environment or in
the configuration file; a read-only one is served read-only and said so. mlx-lm's batched
and sequential paths share this one start-up."""

from __future__ import annotations

import faults
import harness
import pytest

VAR = "KVPLUGIN_SSD_CACHE_DIR"


# one process per way the directory is unusable; the environment once (the check is the
# same, only the message's "got ..." differs), the configuration file below
@pytest.mark.parametrize("kind, by", [("cannot-be-created", "flag"), ("a-file", "env"),
                                      ("unreadable", "flag")])
def test_an_unusable_ssd_dir_stops_the_start(tiny_model, tmp_path, kind, by):
    path, wrap = harness.unusable_ssd_dir(kind, tmp_path)
    port = harness.free_port()
    extra, env = (("--ssd-cache-dir", path), None) if by == "flag" else ((), {VAR: path})
    result, accepted = harness.failed_start(
        wrap(harness.mlx_lm_server_cmd(tiny_model, port, *extra)), port, env=env)
    given = f"--ssd-cache-dir '{path}'" if by == "flag" else f"{VAR}='{path}'"
    harness.assert_refused_ssd_dir(result, accepted, given)


def test_an_unusable_ssd_dir_in_the_config_file_stops_the_start(tiny_model, tmp_path):
    path, _ = harness.unusable_ssd_dir("cannot-be-created", tmp_path)
    config = tmp_path / "kvplugin.toml"
    config.write_text(f"ssd_cache_dir = {path!r}\n")
    port = harness.free_port()
    result, accepted = harness.failed_start(
        harness.mlx_lm_server_cmd(tiny_model, port), port, env={"KVPLUGIN_CONFIG": str(config)})
    harness.assert_refused_ssd_dir(result, accepted, f"ssd_cache_dir = '{path}' in {config}")


def test_a_read_only_ssd_dir_is_served_read_only(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    ssd.mkdir()
    with faults.read_only(ssd):
        port = harness.free_port()
        with harness.ServerProcess(
                harness.mlx_lm_server_cmd(tiny_model, port, "--ssd-cache-dir", str(ssd),
                                          "--prompt-cache-bytes", "1"),  # every entry spills
                port=port, workdir=tmp_path / "server").start() as srv:
            assert harness.answer_text(srv.chat("Tell me about the bridge.", max_tokens=4))
            tier = harness.wait_cold_tier(srv, "refused", 1)  # mlx-lm stores after answering
            log = srv.log_text()
    assert tier["puts"] == 0 and tier["write_failures"] == 0, tier  # refused, not failed
    said = [ln for ln in log.splitlines() if "read-only" in ln and str(ssd) in ln]
    assert len(said) == 1 and said[0].startswith("kvplugin: "), log[-3000:]
