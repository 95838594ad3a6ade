from __future__ import annotations

import pytest

from kvplugin.provenance import notices, setting_sources
from kvplugin.settings import ALLOWED_BITS, SettingsError, option_infos, resolve_settings


def test_defaults():
    s = resolve_settings()
    assert s.kv_cache_quantization is False
    assert s.kv_cache_quantization_bits == 8
    assert s.kv_cache_quantization_group_size == 64
    assert s.kv_cache_min_quantize_tokens == 256
    assert s.max_kv_size is None
    assert s.kv_cache_step is None
    assert s.hot_cache_only is False
    assert s.ssd_cache_dir is None
    assert s.ssd_cache_max_gb == 10.0
    assert set(setting_sources().values()) == {"default"}


def test_env_overrides_default(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION_BITS", "4")
    monkeypatch.setenv("KVPLUGIN_MAX_KV_SIZE", "1024")
    s = resolve_settings()
    assert (s.kv_cache_quantization_bits, s.max_kv_size) == (4, 1024)
    src = setting_sources()
    assert src["kv_cache_quantization_bits"] == "env"
    assert src["max_kv_size"] == "env"
    assert src["kv_cache_step"] == "default"


def test_flag_overrides_env(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION_BITS", "4")
    monkeypatch.setenv("KVPLUGIN_HOT_CACHE_ONLY", "yes")
    flags = {"kv_cache_quantization_bits": 6, "hot_cache_only": False}
    s = resolve_settings(flags)
    assert s.kv_cache_quantization_bits == 6
    assert s.hot_cache_only is False  # a flag can also switch an env boolean off
    assert setting_sources(flags)["kv_cache_quantization_bits"] == "flag"


def test_none_flag_means_not_given(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_STEP", "512")
    assert resolve_settings({"kv_cache_step": None}).kv_cache_step == 512


def test_empty_env_is_not_set(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_MAX_KV_SIZE", "")
    assert resolve_settings().max_kv_size is None


@pytest.mark.parametrize(
    "raw,expected",
    [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True),
     ("0", False), ("false", False), ("no", False), ("off", False)],
)
def test_env_boolean_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION", raw)
    assert resolve_settings().kv_cache_quantization is expected


@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_every_allowed_bit_width(bits):
    assert resolve_settings({"kv_cache_quantization_bits": bits}).kv_cache_quantization_bits == bits


BAD_VALUES = [
    ("kv_cache_quantization", "maybe", "true/false"),
    ("kv_cache_quantization_bits", "7", "2, 3, 4, 5, 6, 8"),
    ("kv_cache_quantization_bits", "eight", "2, 3, 4, 5, 6, 8"),
    ("kv_cache_quantization_group_size", "48", "32, 64, 128"),
    ("kv_cache_min_quantize_tokens", "-1", ">= 0"),
    ("max_kv_size", "0", "> 0"),
    ("max_kv_size", "-5", "> 0"),
    ("kv_cache_step", "0", "> 0"),
    ("ssd_cache_max_gb", "0", "> 0"),
    ("ssd_cache_max_gb", "lots", "> 0"),
    ("kv_cache_quantization_policy", "sometimes", "always, pressure"),
]


@pytest.mark.parametrize("field,raw,allowed", BAD_VALUES)
def test_bad_env_value_names_flag_env_and_allowed(monkeypatch, field, raw, allowed):
    info = next(i for i in option_infos() if i.field == field)
    monkeypatch.setenv(info.env, raw)
    with pytest.raises(SettingsError) as exc:
        resolve_settings()
    msg = str(exc.value)
    assert info.flag in msg and info.env in msg and allowed in msg and raw in msg


@pytest.mark.parametrize("field,raw,allowed", BAD_VALUES)
def test_bad_flag_value_names_flag_env_and_allowed(field, raw, allowed):
    info = next(i for i in option_infos() if i.field == field)
    with pytest.raises(SettingsError) as exc:
        resolve_settings({field: raw})
    msg = str(exc.value)
    assert info.flag in msg and info.env in msg and allowed in msg


def test_all_errors_reported_at_once(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION_BITS", "7")
    with pytest.raises(SettingsError) as exc:
        resolve_settings({"max_kv_size": 0})
    assert "--kv-cache-quantization-bits" in str(exc.value)
    assert "--max-kv-size" in str(exc.value)


def test_ssd_dir_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SettingsError) as exc:
        resolve_settings({"ssd_cache_dir": str(blocker / "sub")})
    assert "--ssd-cache-dir" in str(exc.value) and "KVPLUGIN_SSD_CACHE_DIR" in str(exc.value)


def test_ssd_dir_not_created_by_validation(tmp_path):
    target = tmp_path / "a" / "b"
    assert resolve_settings({"ssd_cache_dir": str(target)}).ssd_cache_dir == target
    assert not (tmp_path / "a").exists()


def test_hot_only_wins_over_ssd_dir(tmp_path, monkeypatch):
    # Was an error in the first wave; --hot-cache-only is now a switch over any tier.
    monkeypatch.setenv("KVPLUGIN_HOT_CACHE_ONLY", "1")
    flags = {"ssd_cache_dir": str(tmp_path)}
    s = resolve_settings(flags)
    assert s.ssd_cache_dir == tmp_path and s.cold_tier_dir is None
    lines = notices(s, setting_sources(flags))
    assert len(lines) == 1 and "--hot-cache-only wins" in lines[0] and str(tmp_path) in lines[0]
    assert resolve_settings({"ssd_cache_dir": str(tmp_path), "hot_cache_only": False}).cold_tier_dir == tmp_path


def test_unknown_flag_rejected():
    with pytest.raises(SettingsError):
        resolve_settings({"no_such_option": 1})


def test_settings_are_frozen():
    s = resolve_settings()
    with pytest.raises(Exception):
        s.max_kv_size = 5  # type: ignore[misc]


def test_a_remote_url_password_is_never_printed(monkeypatch):
    from kvplugin import info

    monkeypatch.setenv("KVPLUGIN_KV_CACHE_REMOTE", "http://user:s3cret@host:6379/0")
    with pytest.raises(SettingsError) as err:
        resolve_settings({})
    assert "s3cret" not in str(err.value) and "KVPLUGIN_KV_CACHE_REMOTE" in str(err.value)
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_REMOTE", "redis://user:s3cret@host:6379/0")
    text = info.render(info.collect({}))
    assert "redis://user:***@host:6379/0" in text and "s3cret" not in text


def test_pressure_policy_implies_quantization(monkeypatch):
    """A policy for quantized entries, given alone, means quantized entries (like the bits)."""
    assert resolve_settings().kv_cache_quantization_policy == "always"
    assert resolve_settings({"kv_cache_quantization_policy": "always"}).kv_cache_quantization
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION_POLICY", "pressure")
    s = resolve_settings()
    assert s.kv_cache_quantization and s.kv_cache_quantization_policy == "pressure"
