"""Each host is declared once (``kvplugin/hostspecs.py``); everything else must agree.

pyproject's extras and ``kvplugin.hosts`` entry points, ``tox.ini``'s matrix and pins, the
README's install pins and the adapters themselves are checked against the declarations,
so a new host version is one edit plus whatever this test then names.
"""

from __future__ import annotations

import configparser
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvplugin import hosts
from kvplugin.hostspecs import BUILTIN_HOSTS, KNOWN_HOSTS, UNSUPPORTED_HOSTS, declaration

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOX = (ROOT / "tox.ini").read_text()
PIN = re.compile(r"\b(mlx-lm|vllm-mlx|mlx-openai-server)==([0-9][0-9.]*[0-9])")


def _requirements(extra: str) -> list[Requirement]:
    return [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]


@pytest.mark.parametrize("decl", BUILTIN_HOSTS, ids=lambda d: d.name)
def test_extra_range_equals_declared_range(decl):
    reqs = [r for r in _requirements(decl.name) if r.name == decl.distribution]
    if decl.extra_requires_host:
        assert len(reqs) == 1, f"extra {decl.name!r} must require {decl.distribution}"
        assert reqs[0].specifier == SpecifierSet(decl.supported)
    else:  # installed on its own with --no-deps: the documented pin must be supported
        assert reqs == []
        pins = [Version(v) for d, v in PIN.findall(decl.install) if d == decl.distribution]
        assert pins and all(p in SpecifierSet(decl.supported) for p in pins), decl.install


def test_every_host_pin_in_every_extra_is_supported():
    """The vllm-mlx extra pins mlx-lm: that pin must be inside mlx-lm's range too."""
    ranges = {d.distribution: SpecifierSet(d.supported) for d in BUILTIN_HOSTS}
    checked = 0
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        for req in _requirements(extra):
            if req.name in ranges:
                for spec in req.specifier:
                    if spec.operator == "==":
                        assert Version(spec.version) in ranges[req.name], (extra, str(req))
                        checked += 1
    assert checked >= 1


def test_tox_envs_are_the_declared_tested_versions():
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(TOX)
    env_list = parser["tox"]["env_list"].split()  # longest first (tox.ini says why)
    assert sorted(env_list) == sorted(env for decl in KNOWN_HOSTS for env in decl.tox_envs())
    assert len(set(env_list)) == len(env_list)


@pytest.mark.parametrize("decl", BUILTIN_HOSTS, ids=lambda d: d.name)
def test_tox_pins_are_tested_and_inside_the_declared_range(decl):
    pins = [v for dist, v in PIN.findall(TOX) if dist == decl.distribution]
    host_pins = sorted(set(pins), key=Version)
    assert host_pins == sorted(decl.tested, key=Version)
    for version in decl.tested:
        assert Version(version) in SpecifierSet(decl.supported), version


@pytest.mark.parametrize("decl", UNSUPPORTED_HOSTS, ids=lambda d: d.name)
def test_tox_pins_a_recognized_host_at_its_tested_versions(decl):
    """A host kvplugin recognizes and does not back: tox proves its start-up line on the
    versions the declaration names (they are no supported range)."""
    pins = re.findall(rf"\b{re.escape(decl.distribution)}==([0-9][0-9.]*[0-9])\b", TOX)
    assert pins and sorted(set(pins), key=Version) == sorted(decl.tested, key=Version)


def test_readme_install_pins_are_supported():
    ranges = {d.distribution: SpecifierSet(d.supported) for d in BUILTIN_HOSTS}
    pins = PIN.findall((ROOT / "README.md").read_text())
    assert pins
    for dist, version in pins:
        assert Version(version) in ranges[dist], (dist, version)


def test_entry_points_list_the_declared_adapters():
    group = PYPROJECT["project"]["entry-points"][hosts.ENTRY_POINT_GROUP]
    assert group == {decl.name: decl.adapter for decl in BUILTIN_HOSTS}


def test_installed_metadata_has_the_entry_points():
    """The installed kvplugin (tox builds a wheel) exposes the group get_adapter reads."""
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group=hosts.ENTRY_POINT_GROUP)}
    for decl in BUILTIN_HOSTS:
        assert found.get(decl.name) == decl.adapter


@pytest.mark.parametrize("decl", BUILTIN_HOSTS, ids=lambda d: d.name)
def test_adapters_take_their_identity_from_the_declaration(decl):
    adapter = hosts.get_adapter(decl.name)
    assert type(adapter).declaration is decl  # built from it: class X(HostAdapter, declaration=)
    assert adapter.name == decl.name
    assert adapter.distribution == decl.distribution
    assert adapter.trigger_module == decl.trigger_module
    assert adapter.supported == SpecifierSet(decl.supported)
    assert declaration(decl.name) is decl


def test_a_third_host_is_found_through_the_entry_point_group(monkeypatch):
    import importlib.metadata as md

    from kvplugin.hosts.base import HostAdapter

    class ThirdAdapter(HostAdapter):
        name = "third-host"
        distribution = "third-host"
        supported = SpecifierSet(">=1")
        trigger_module = "third_host.server"

    module = types.ModuleType("third_host_plugin")
    module.ADAPTER = ThirdAdapter()
    monkeypatch.setitem(sys.modules, "third_host_plugin", module)
    real = md.entry_points

    def entry_points(**kw):
        eps = list(real(**kw))
        if kw.get("group") == hosts.ENTRY_POINT_GROUP:
            eps.append(md.EntryPoint("third-host", "third_host_plugin:ADAPTER", kw["group"]))
        return eps

    monkeypatch.setattr(md, "entry_points", entry_points)
    assert hosts.get_adapter("third-host") is module.ADAPTER
    # the installed metadata lists the group's entry points by name
    assert [a.name for a in hosts.all_adapters()] == [*sorted(d.name for d in BUILTIN_HOSTS),
                                                      "third-host",
                                                      *(d.name for d in UNSUPPORTED_HOSTS)]
    with pytest.raises(KeyError, match="third-host"):
        hosts.get_adapter("fourth-host")


def test_launch_commands_come_from_the_declaration(monkeypatch, tmp_path):
    from kvplugin.tools import hostcmd

    monkeypatch.setattr(hostcmd, "venv_script", lambda name: tmp_path / name)
    cmd = hostcmd.vllm_mlx_serve_cmd("/m", 8000, "--x")
    assert cmd == [str(tmp_path / "vllm-mlx"), "serve", "/m", "--host", "127.0.0.1",
                   "--port", "8000", "--offline", "--served-model-name",
                   hostcmd.SERVED_MODEL_NAME, "--x"]
    cmd = hostcmd.mlx_lm_server_cmd("/m", 8001)
    assert cmd == [str(tmp_path / "mlx_lm.server"), "--model", "/m", "--host", "127.0.0.1",
                   "--port", "8001"]
