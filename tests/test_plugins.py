"""The plugin manager and third-party override through a real entry point."""

from __future__ import annotations

import sys
import textwrap

import pytest

from kvplugin import hookspecs, plugins
from kvplugin.default_plugins import DEFAULT_PLUGINS


@pytest.fixture
def plugin_distribution(tmp_path, monkeypatch):
    """An installed distribution 'kvp-example' registering a plugin in group 'kvplugin'."""
    (tmp_path / "kvp_example.py").write_text(
        textwrap.dedent(
            """
            from kvplugin.hookspecs import hookimpl

            TRIMMED = []

            @hookimpl
            def kvplugin_trim_entry(cache):
                TRIMMED.append(cache)
                return ["trimmed-by-example"]

            @hookimpl
            def kvplugin_quantize_entry(cache, num_tokens, settings):
                return None  # declines: the built-in decides
            """
        )
    )
    dist = tmp_path / "kvp_example-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-example\nVersion: 1.2.3\n")
    (dist / "entry_points.txt").write_text("[kvplugin]\nexample = kvp_example\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "example"
    sys.modules.pop("kvp_example", None)


def test_builtin_registered_without_entry_points():
    # was one plugin named "builtin"; now one default plugin per concern, origin "builtin"
    pm = plugins.create_plugin_manager(load_entry_points=False)
    assert [p.name for p in plugins.list_plugins(pm)] == ["bound", "quantize", "storage", "trim"]
    assert {p.origin for p in plugins.list_plugins(pm)} == {"builtin"}


def test_entry_point_plugin_overrides_builtin(plugin_distribution):
    pm = plugins.get_plugin_manager()
    names = {p.name: p.origin for p in plugins.list_plugins(pm)}
    assert names[plugin_distribution] == "kvp-example 1.2.3"
    assert pm.hook.kvplugin_trim_entry(cache=["x"]) == ["trimmed-by-example"]
    assert sys.modules["kvp_example"].TRIMMED == [["x"]]


def test_entry_points_loaded_once_per_process(plugin_distribution):
    assert plugins.get_plugin_manager() is plugins.get_plugin_manager()


def test_blocking_a_plugin_by_name(plugin_distribution, monkeypatch):
    monkeypatch.setenv("KVPLUGIN_BLOCK_PLUGINS", plugin_distribution)
    pm = plugins.create_plugin_manager()
    assert plugin_distribution not in {p.name for p in plugins.list_plugins(pm)}
    assert pm.hook.kvplugin_trim_entry(cache=[]) == []  # the built-in answered


def test_builtins_are_trylast():
    pm = plugins.create_plugin_manager(load_entry_points=False)
    for caller in pm.hook.__dict__.values():
        for impl in caller.get_hookimpls():
            if impl.plugin_name in DEFAULT_PLUGINS:
                assert impl.trylast, caller.name


def _dist(tmp_path, monkeypatch, module: str, source: str, ep_name: str) -> str:
    """Install a one-module distribution with a ``kvplugin`` entry point (on sys.path)."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    dist = tmp_path / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[kvplugin]\n{ep_name} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return ep_name


def test_blocking_one_default_plugin_leaves_the_others(monkeypatch):
    from kvplugin.settings import resolve_settings

    monkeypatch.setenv("KVPLUGIN_BLOCK_PLUGINS", "quantize")
    pm = plugins.create_plugin_manager(load_entry_points=False)
    assert [p.name for p in plugins.list_plugins(pm)] == ["bound", "storage", "trim"]
    s = resolve_settings({"kv_cache_quantization": True, "kv_cache_min_quantize_tokens": 0})
    assert pm.hook.kvplugin_quantize_entry(cache=[], num_tokens=10, settings=s,
                                          prompt_boundaries=(), stored_prefix=None,
                                          key_ropes=None) is None
    assert pm.hook.kvplugin_trim_entry(cache=[]) == []  # trim still answers


def test_builtin_blocks_all_default_plugins(monkeypatch):
    monkeypatch.setenv("KVPLUGIN_BLOCK_PLUGINS", "builtin")
    pm = plugins.create_plugin_manager(load_entry_points=False)
    assert plugins.list_plugins(pm) == []
    assert pm.hook.kvplugin_trim_entry(cache=[]) is None


def test_misspelled_hook_is_an_error_naming_the_plugin(tmp_path, monkeypatch):
    name = _dist(tmp_path, monkeypatch, "kvp_typo", """
        from kvplugin.hookspecs import hookimpl

        @hookimpl
        def kvplugin_trim_entri(cache):
            return cache
        """, "typo")
    with pytest.raises(plugins.PluginError) as err:
        plugins.create_plugin_manager()
    assert "'typo'" in str(err.value) and "kvplugin_trim_entri" in str(err.value)
    sys.modules.pop("kvp_typo", None)
    monkeypatch.setenv("KVPLUGIN_BLOCK_PLUGINS", name)  # the way out the message names
    assert name not in {p.name for p in plugins.list_plugins(plugins.create_plugin_manager())}


def test_plugin_needing_a_newer_hook_api_is_not_loaded(tmp_path, monkeypatch, capsys):
    _dist(tmp_path, monkeypatch, "kvp_future", f"""
        from kvplugin.hookspecs import hookimpl

        kvplugin_hook_api_version = {hookspecs.HOOK_API_VERSION + 1}

        @hookimpl
        def kvplugin_trim_entry(cache):
            return ["future"]
        """, "future")
    pm = plugins.create_plugin_manager()
    assert "future" not in {p.name for p in plugins.list_plugins(pm)}
    assert pm.hook.kvplugin_trim_entry(cache=[]) == []
    assert "'future' needs hook API version" in capsys.readouterr().err
    sys.modules.pop("kvp_future", None)


def test_plugin_declaring_the_current_hook_api_is_loaded(tmp_path, monkeypatch):
    _dist(tmp_path, monkeypatch, "kvp_now", f"""
        from kvplugin.hookspecs import hookimpl

        kvplugin_hook_api_version = {hookspecs.HOOK_API_VERSION}

        @hookimpl
        def kvplugin_trim_entry(cache):
            return ["now"]
        """, "now")
    pm = plugins.create_plugin_manager()
    assert pm.hook.kvplugin_trim_entry(cache=[]) == ["now"]
    sys.modules.pop("kvp_now", None)
