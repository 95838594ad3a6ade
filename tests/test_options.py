from __future__ import annotations

import argparse

import pytest

from kvplugin.options import add_options, given_flags, settings_from_namespace
from kvplugin.settings import SettingsError, option_infos


def host_parser_with_existing_flags() -> argparse.ArgumentParser:
    """Shaped like vllm-mlx's serve parser: some options exist already."""
    p = argparse.ArgumentParser(prog="host")
    p.add_argument("--kv-cache-quantization", action="store_true", help="Quantize the cache.")
    p.add_argument("--kv-cache-quantization-bits", type=int, default=8, choices=[4, 8])
    p.add_argument("--max-kv-size", type=int, default=None)
    p.add_argument("--port", type=int, default=8000)
    return p


def test_add_to_plain_parser_adds_every_option():
    p = argparse.ArgumentParser()
    dests = add_options(p)
    assert set(dests) == {i.field for i in option_infos()}
    ns = p.parse_args([])
    assert all(getattr(ns, d) is None for d in dests.values())


def test_adopt_existing_options_without_conflict():
    p = host_parser_with_existing_flags()
    before = p._option_string_actions["--kv-cache-quantization"]
    add_options(p)  # would raise argparse.ArgumentError if it re-added
    assert p._option_string_actions["--kv-cache-quantization"] is before
    ns = p.parse_args(["--kv-cache-quantization", "--kv-cache-quantization-bits", "3"])
    s = settings_from_namespace(p, ns)
    assert s.kv_cache_quantization is True
    assert s.kv_cache_quantization_bits == 3  # widened beyond the host's choices [4, 8]
    assert ns.kv_cache_quantization_bits == 3  # written back for host code


def test_adopted_store_true_not_given_lets_env_win(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_QUANTIZATION", "1")
    p = host_parser_with_existing_flags()
    add_options(p)
    ns = p.parse_args([])
    assert given_flags(p, ns) == {}
    assert settings_from_namespace(p, ns).kv_cache_quantization is True
    assert ns.kv_cache_quantization is True


def test_flag_beats_env_through_parser(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_MAX_KV_SIZE", "100")
    monkeypatch.setenv("KVPLUGIN_HOT_CACHE_ONLY", "1")
    p = argparse.ArgumentParser()
    add_options(p)
    ns = p.parse_args(["--max-kv-size", "200", "--no-hot-cache-only"])
    s = settings_from_namespace(p, ns)
    assert (s.max_kv_size, s.hot_cache_only) == (200, False)


def test_write_back_of_defaults_and_env(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_KV_CACHE_STEP", "1024")
    p = host_parser_with_existing_flags()
    add_options(p)
    ns = p.parse_args([])
    settings_from_namespace(p, ns)
    assert ns.kv_cache_step == 1024
    assert ns.kv_cache_quantization_bits == 8
    assert ns.max_kv_size is None


def test_help_names_env_variables():
    p = host_parser_with_existing_flags()
    add_options(p)
    text = p.format_help()
    for info in option_infos():
        assert info.flag in text
        assert info.env in text


def test_bad_flag_value_raises_settings_error():
    p = argparse.ArgumentParser()
    add_options(p)
    ns = p.parse_args(["--kv-cache-quantization-group-size", "48"])
    with pytest.raises(SettingsError, match="KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE"):
        settings_from_namespace(p, ns)


def test_add_twice_is_harmless():
    p = argparse.ArgumentParser()
    first = add_options(p)
    assert add_options(p) == first


def test_only_restricts_fields():
    p = argparse.ArgumentParser()
    dests = add_options(p, only={"hot_cache_only"})
    assert list(dests) == ["hot_cache_only"]
    assert "--max-kv-size" not in p.format_help()


def test_hot_cache_only_hides_the_ssd_dir_from_the_host(tmp_path, monkeypatch):
    # vllm-mlx reads --ssd-cache-dir itself: under --hot-cache-only it must see none.
    parser = argparse.ArgumentParser()
    parser.add_argument("--ssd-cache-dir", default=None)
    add_options(parser)
    monkeypatch.setenv("KVPLUGIN_SSD_CACHE_DIR", str(tmp_path))
    ns = parser.parse_args(["--hot-cache-only"])
    settings = settings_from_namespace(parser, ns)
    assert settings.ssd_cache_dir == tmp_path and ns.ssd_cache_dir is None
