"""Configuration file, strict booleans, unknown variables and implied quantization.

Each rule exists because its absence was a silent no-op for a user: a typo'd variable, a
``maybe``, ``--kv-cache-quantization-bits 4`` alone, or options kept in a file.
"""

from __future__ import annotations

import pytest

from kvplugin import log
from kvplugin.provenance import config_file_in_force, notices, setting_sources
from kvplugin.settings import SettingsError, resolve_settings


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path


def test_toml_file_precedence_flag_env_file_default(in_tmp, monkeypatch):
    (in_tmp / "kvplugin.toml").write_text(
        "max_kv_size = 2048\nkv_cache_step = 512\nkv_cache_quantization_bits = 4\n"
    )
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_STEP", "1024")
    flags = {"kv_cache_quantization_bits": 6}
    s = resolve_settings(flags)
    assert (s.max_kv_size, s.kv_cache_step, s.kv_cache_quantization_bits) == (2048, 1024, 6)
    assert s.kv_cache_min_quantize_tokens == 256  # default
    src = setting_sources(flags)
    assert src["max_kv_size"] == "file"
    assert src["kv_cache_step"] == "env"
    assert src["kv_cache_quantization_bits"] == "flag"
    assert src["kv_cache_min_quantize_tokens"] == "default"
    assert config_file_in_force().path == in_tmp / "kvplugin.toml"


def test_pyproject_table_is_read_only_when_present(in_tmp):
    (in_tmp / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert config_file_in_force() is None
    (in_tmp / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.kvplugin]\nmax_kv_size = 777\n')
    assert resolve_settings().max_kv_size == 777
    assert config_file_in_force().table == ("tool", "kvplugin")


def test_kvplugin_toml_beats_pyproject_and_explicit_beats_both(in_tmp, monkeypatch):
    (in_tmp / "pyproject.toml").write_text("[tool.kvplugin]\nmax_kv_size = 1\n")
    (in_tmp / "kvplugin.toml").write_text("max_kv_size = 2\n")
    assert resolve_settings().max_kv_size == 2
    other = in_tmp / "elsewhere.toml"
    other.write_text("max_kv_size = 3\n")
    monkeypatch.setenv("KVPLUGIN_CONFIG", str(other))
    assert resolve_settings().max_kv_size == 3


def test_user_config_file_is_the_last_resort(in_tmp):
    user = in_tmp / "xdg" / "kvplugin" / "kvplugin.toml"
    user.parent.mkdir(parents=True)
    user.write_text("kv_cache_step = 4096\n")
    assert resolve_settings().kv_cache_step == 4096


def test_missing_explicit_config_is_an_error(in_tmp, monkeypatch):
    monkeypatch.setenv("KVPLUGIN_CONFIG", str(in_tmp / "nope.toml"))
    with pytest.raises(SettingsError, match="KVPLUGIN_CONFIG"):
        resolve_settings()


def test_bad_toml_and_unknown_key_name_the_file(in_tmp):
    (in_tmp / "kvplugin.toml").write_text("max_kv_size = [\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        resolve_settings()
    (in_tmp / "kvplugin.toml").write_text("max_kv = 5\n")
    with pytest.raises(SettingsError) as exc:
        resolve_settings()
    assert "max_kv" in str(exc.value) and "max_kv_size" in str(exc.value)


def test_bad_file_value_names_flag_env_and_file(in_tmp):
    (in_tmp / "kvplugin.toml").write_text("kv_cache_quantization_bits = 7\n")
    with pytest.raises(SettingsError) as exc:
        resolve_settings()
    msg = str(exc.value)
    assert "--kv-cache-quantization-bits" in msg and "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS" in msg
    assert "kvplugin.toml" in msg


@pytest.mark.parametrize("raw", ["maybe", "t", "y", "2", "enabled"])
def test_boolean_variables_accept_only_documented_words(monkeypatch, raw):
    monkeypatch.setenv("KVPLUGIN_HOT_CACHE_ONLY", raw)
    with pytest.raises(SettingsError, match="KVPLUGIN_HOT_CACHE_ONLY"):
        resolve_settings()


@pytest.mark.parametrize("raw", ["maybe", "2"])
def test_disable_variable_is_checked(monkeypatch, raw):
    monkeypatch.setenv("KVPLUGIN_DISABLE", raw)
    with pytest.raises(SettingsError, match="KVPLUGIN_DISABLE"):
        resolve_settings()


def test_unknown_variable_warns_with_closest_name(monkeypatch, capsys):
    log.forget()
    monkeypatch.setenv("KVPLUGIN_MAX_KV", "4096")
    monkeypatch.setenv("KVPLUGIN_FOO", "1")
    assert resolve_settings().max_kv_size is None
    err = capsys.readouterr().err
    assert "unknown variable KVPLUGIN_MAX_KV is ignored (did you mean KVPLUGIN_MAX_KV_SIZE?)" in err
    assert "unknown variable KVPLUGIN_FOO is ignored" in err
    resolve_settings()
    assert capsys.readouterr().err == ""  # said once


@pytest.mark.parametrize(
    "flags",
    [
        {"kv_cache_quantization_bits": 4},
        {"kv_cache_quantization_group_size": 32},
        {"kv_cache_min_quantize_tokens": 512},
    ],
)
def test_quantization_detail_alone_turns_quantization_on(flags):
    s = resolve_settings(flags)
    assert s.kv_cache_quantization is True
    src = setting_sources(flags)
    assert src["kv_cache_quantization"] == "implied"
    assert any("turns entry quantization on" in line for line in notices(s, src))


def test_explicit_off_beats_implied(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION_BITS", "4")
    s = resolve_settings({"kv_cache_quantization": False})
    assert s.kv_cache_quantization is False
    assert notices(s, setting_sources({"kv_cache_quantization": False})) == []


def test_defaults_imply_nothing():
    s = resolve_settings()
    assert s.kv_cache_quantization is False
    assert notices(s, setting_sources()) == []


def test_explicit_config_that_is_a_directory_or_unreadable_names_the_variable(in_tmp, monkeypatch):
    monkeypatch.setenv("KVPLUGIN_CONFIG", str(in_tmp))
    with pytest.raises(SettingsError, match="KVPLUGIN_CONFIG=.*a directory, not a file"):
        resolve_settings()
    config = in_tmp / "kv.toml"
    config.write_text("max_kv_size = 5\n")
    monkeypatch.setenv("KVPLUGIN_CONFIG", str(config))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(config), "open", refuse)
    with pytest.raises(SettingsError, match=r"cannot read .*kv.toml \(KVPLUGIN_CONFIG\): Perm"):
        resolve_settings()
