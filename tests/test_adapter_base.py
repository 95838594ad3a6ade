"""Version gating and the patch registry of host adapters."""

from __future__ import annotations

import types

import pytest
from packaging.specifiers import SpecifierSet

from kvplugin.hosts.base import HostAdapter, PatchRegistry


class Host:
    def method(self):
        return "stock"

    @staticmethod
    def static():
        return "stock"

    @classmethod
    def klass(cls):
        return "stock"


def test_restore_all_restores_identity():
    module = types.ModuleType("fakehost")
    module.func = lambda: "stock"
    originals = {
        "method": Host.__dict__["method"],
        "static": Host.__dict__["static"],
        "klass": Host.__dict__["klass"],
    }
    func = module.func
    reg = PatchRegistry()
    for name in originals:
        reg.replace(Host, name, lambda *a: "patched")
    reg.replace(module, "func", lambda: "patched")
    assert Host().method() == "patched" and module.func() == "patched"
    reg.restore_all()
    assert len(reg) == 0
    for name, original in originals.items():
        assert Host.__dict__[name] is original
    assert module.func is func
    assert Host.static() == "stock" and Host.klass() == "stock"


def test_patching_inherited_attribute_restores_by_deletion():
    class Child(Host):
        pass

    reg = PatchRegistry()
    reg.replace(Child, "method", lambda self: "patched")
    assert Child().method() == "patched"
    reg.restore_all()
    assert "method" not in Child.__dict__ and Child().method() == "stock"


def test_missing_attribute_is_an_error():
    with pytest.raises(AttributeError):
        PatchRegistry().replace(Host, "nope", 1)


class FakeAdapter(HostAdapter):
    name = "fake"
    distribution = "pluggy"  # an installed distribution with a real version
    supported = SpecifierSet(">=1.0")
    trigger_module = "fakehost"

    def __init__(self, fail_after: int | None = None):
        super().__init__()
        self.fail_after = fail_after

    def apply(self, module, patches):
        patches.replace(module, "a", "patched-a")
        if self.fail_after == 1:
            raise RuntimeError("seam changed")
        patches.replace(module, "b", "patched-b")


def fake_module():
    m = types.ModuleType("fakehost")
    m.a, m.b = "stock-a", "stock-b"
    return m


def test_install_and_uninstall():
    m = fake_module()
    adapter = FakeAdapter()
    assert adapter.install(m) is True
    assert (m.a, m.b) == ("patched-a", "patched-b")
    assert adapter.install(m) is True  # idempotent: patches applied once
    assert len(adapter.registry) == 2
    adapter.uninstall()
    assert (m.a, m.b) == ("stock-a", "stock-b")


def test_install_is_all_or_nothing(capsys):
    m = fake_module()
    assert FakeAdapter(fail_after=1).install(m) is False
    assert (m.a, m.b) == ("stock-a", "stock-b")
    assert "seam changed" in capsys.readouterr().err


def test_unsupported_version_warns_once_and_patches_nothing(capsys):
    class Old(FakeAdapter):
        supported = SpecifierSet("<0.1")

    m = fake_module()
    adapter = Old()
    assert adapter.install(m) is False
    assert adapter.install(m) is False
    assert (m.a, m.b) == ("stock-a", "stock-b")
    err = capsys.readouterr().err
    assert err.count("outside kvplugin's supported range") == 1
    assert "runs stock" in err


def test_not_installed_distribution():
    class Absent(FakeAdapter):
        distribution = "no-such-distribution-kvp"

    assert "not installed" in Absent().support_problem()


def _pm_with(monkeypatch, *extra):
    from kvplugin import plugins

    pm = plugins.create_plugin_manager(load_entry_points=False)
    for plugin in extra:
        pm.register(plugin)
    monkeypatch.setattr(plugins, "get_plugin_manager", lambda: pm)


def test_a_session_that_cannot_be_built_is_a_settings_error(monkeypatch):
    # never a reason to serve stock: what fails here is the configuration or a plugin
    from kvplugin.hookspecs import hookimpl
    from kvplugin.settings import SettingsError, resolve_settings

    class Broken:
        @hookimpl
        def kvplugin_configure(self, settings, host):
            raise RuntimeError("plugin bug")

    _pm_with(monkeypatch, Broken())
    with pytest.raises(SettingsError, match=r"prompt store \(RuntimeError: plugin bug\)"):
        FakeAdapter().make_session(resolve_settings(), max_bytes=None, max_entries=None)


def test_an_ssd_dir_gone_bad_after_the_check_names_flag_and_variable(monkeypatch):
    from pathlib import Path

    from kvplugin.settings import SettingsError, resolve_settings

    _pm_with(monkeypatch)
    settings = resolve_settings().model_copy(  # as if it changed after the settings' check
        update={"ssd_cache_dir": Path("/proc/kvplugin-test/kv")})
    with pytest.raises(SettingsError) as exc:
        FakeAdapter().make_session(settings, max_bytes=None, max_entries=None)
    assert "--ssd-cache-dir / KVPLUGIN_SSD_CACHE_DIR" in str(exc.value)
    assert "/proc/kvplugin-test/kv" in str(exc.value)
