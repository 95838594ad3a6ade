"""The plugin manager and third-party override through a real entry point."""

from __future__ import annotations

import sys
import textwrap

import pytest

from kvplugin import plugins


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
    pm = plugins.create_plugin_manager(load_entry_points=False)
    assert [p.name for p in plugins.list_plugins(pm)] == ["builtin"]
    assert plugins.list_plugins(pm)[0].origin == "built-in"


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
            if impl.plugin_name == plugins.BUILTIN_NAME:
                assert impl.trylast, caller.name
