"""Hosts kvplugin recognizes and never patches (rapid-mlx), and the vllm-mlx adapter's
identity check that tells vllm-mlx from a fork's ``vllm_mlx`` by file ownership.

Fake distributions (``*.dist-info`` with a RECORD) and fake host packages in a temp dir;
the real host is covered by ``integration/test_rapid_mlx_startup.py``.
"""

from __future__ import annotations

import importlib.metadata
import textwrap
import types
from pathlib import Path

import pytest

from kvplugin import _bootstrap, cli
from kvplugin.hosts import get_adapter, unsupported
from kvplugin.hosts.vllm_mlx.adapter import VllmMlxAdapter
from kvplugin.hostspecs import RAPID_MLX, UNSUPPORTED_HOSTS

from test_bootstrap import parse, run_python

RAPID_LINE = "kvplugin: rapid-mlx {} is not supported; the server runs stock"


def fake_dist(site: Path, name: str, version: str, files: tuple[str, ...] = ()) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def fake_vllm_mlx_package(site: Path) -> Path:
    """``vllm_mlx`` with a ``cli`` shaped like the one the adapter patches."""
    pkg = site / "vllm_mlx"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text(textwrap.dedent("""
        def create_parser():
            return None
        def serve_command(args):
            return "served"
    """))
    return pkg / "cli.py"


VLLM_FILES = ("vllm_mlx/__init__.py", "vllm_mlx/cli.py")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site dir whose distributions are the only ones importlib.metadata sees."""
    site = tmp_path / "site"
    site.mkdir()
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions",
                        lambda **kw: real(path=[str(site)], **kw))

    def distribution(name):
        for dist in real(path=[str(site)]):
            if dist.metadata["Name"] == name:
                return dist
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: distribution(name).version)
    return site


def cli_module(path: Path) -> types.ModuleType:
    module = types.ModuleType("vllm_mlx.cli")
    module.__file__ = str(path)
    exec(path.read_text(), module.__dict__)
    return module


def install_and_capture(module, capsys) -> tuple[bool, str, VllmMlxAdapter]:
    adapter = VllmMlxAdapter()
    before = dict(vars(module))
    ok = adapter.install(module)
    assert vars(module) == before  # nothing of the module was replaced
    return ok, capsys.readouterr().err, adapter


# --------------------------------------------------------------------------- identity


def test_a_fork_owning_vllm_mlx_says_its_own_line(site, capsys):
    """rapid-mlx 0.14.2 and earlier ship the real package as ``vllm_mlx``, no vllm-mlx."""
    path = fake_vllm_mlx_package(site)
    fake_dist(site, "rapid-mlx", "0.14.2", VLLM_FILES)
    module = cli_module(path)
    problem = VllmMlxAdapter().check_identity(module)
    assert problem == f"the imported vllm_mlx.cli ({path}) belongs to rapid-mlx, not vllm-mlx"
    ok, err, adapter = install_and_capture(module, capsys)
    assert not ok and not adapter.installed
    assert err == RAPID_LINE.format("0.14.2") + "\n"


def test_the_fork_wins_over_an_installed_vllm_mlx_that_does_not_own_the_file(site, capsys):
    path = fake_vllm_mlx_package(site)
    fake_dist(site, "rapid-mlx", "0.14.2", VLLM_FILES)
    fake_dist(site, "vllm-mlx", "0.6.0", ("vllm_mlx/other.py",))
    ok, err, _ = install_and_capture(cli_module(path), capsys)
    assert not ok and err == RAPID_LINE.format("0.14.2") + "\n"


def test_an_unknown_owner_is_named(site, capsys):
    path = fake_vllm_mlx_package(site)
    fake_dist(site, "some-fork", "1.0", VLLM_FILES)
    ok, err, _ = install_and_capture(cli_module(path), capsys)
    assert not ok
    assert err == (f"kvplugin: the imported vllm_mlx.cli ({path}) belongs to some-fork, "
                   "not vllm-mlx; vllm-mlx runs stock\n")


def test_no_owner_and_no_vllm_mlx(site, capsys):
    path = fake_vllm_mlx_package(site)
    ok, err, _ = install_and_capture(cli_module(path), capsys)
    assert not ok
    assert err == (f"kvplugin: vllm-mlx is not installed (vllm_mlx.cli is {path}); "
                   "vllm-mlx runs stock\n")


def test_vllm_mlx_owning_its_files_passes_identity_then_the_version_decides(site):
    path = fake_vllm_mlx_package(site)
    fake_dist(site, "vllm-mlx", "0.6.0", VLLM_FILES)
    adapter = VllmMlxAdapter()
    assert adapter.check_identity(cli_module(path)) is None
    assert adapter.support_problem(cli_module(path)) is None
    (site / "vllm_mlx-0.6.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-mlx\nVersion: 0.9.0\n")
    assert "0.9.0 is outside" in adapter.support_problem(cli_module(path))


def test_the_old_fork_layout_through_the_real_bootstrap(tmp_path):
    """``import vllm_mlx.cli`` of a fork in a fresh interpreter: kvplugin's .pth trigger,
    the vllm-mlx adapter, and the fork's one line; nothing patched."""
    fake_vllm_mlx_package(tmp_path)
    fake_dist(tmp_path, "rapid-mlx", "0.14.2", VLLM_FILES)
    code = ("import vllm_mlx.cli as c\n"
            "print('STOCK=' + str(c.serve_command(None) == 'served' and "
            "not hasattr(c.serve_command, '__kvplugin_original__')))\n")
    r = run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout)["STOCK"] == "True"
    assert r.stderr == RAPID_LINE.format("0.14.2") + "\n"


# --------------------------------------------------------------------------- recognized hosts


def make_fork(root: Path) -> None:
    """``fakefork.server``: its ``__main__`` block calls ``entry()``, not ``main()``."""
    pkg = root / "fakefork"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text(textwrap.dedent("""
        import sys
        def main():
            print("RAN=main")
        def entry():
            print("RAN=entry")
            print("NAME=" + __name__)
        if __name__ == "__main__":
            entry()
    """))
    fake_dist(root, "fakefork", "2.0")


FORK = """
import kvplugin._bootstrap as b
from kvplugin.hosts import unsupported
from kvplugin.hostspecs import UnsupportedHost
b.TRIGGERS["fakefork.server"] = "kvplugin.hosts.unsupported"
b.STOCK_MAIN.add("fakefork.server")
unsupported.ADAPTERS["fakefork"] = unsupported.UnsupportedHostAdapter(UnsupportedHost(
    name="fakefork", distribution="fakefork", trigger_module="fakefork.server",
    adapter="x:y", console_script="fakefork", launch=()))
"""


def test_a_recognized_host_says_one_line_on_import_and_is_left_alone(tmp_path):
    make_fork(tmp_path)
    code = FORK + ("import fakefork.server as s, importlib, sys\n"
                   "sys.modules.pop('fakefork.server')\n"
                   "importlib.import_module('fakefork.server')\n"
                   "s.entry()\n")
    r = run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout)["RAN"] == "entry"
    assert r.stderr == "kvplugin: fakefork 2.0 is not supported; the server runs stock\n"


@pytest.mark.parametrize("disable", ["", "1"])
def test_python_dash_m_of_a_recognized_host_runs_its_own_main_block(tmp_path, disable):
    """Not the stand-in that calls ``main()``: the module's own code, as ``__main__``."""
    make_fork(tmp_path)
    code = FORK + ("import runpy\n"
                   "runpy.run_module('fakefork.server', run_name='__main__', alter_sys=True)\n")
    r = run_python(code, tmp_path, KVPLUGIN_DISABLE=disable)
    assert r.returncode == 0, r.stderr
    out = parse(r.stdout)
    assert out["RAN"] == "entry" and out["NAME"] == "__main__"
    said = ("disabled by KVPLUGIN_DISABLE; fakefork.server runs stock" if disable
            else "fakefork 2.0 is not supported; the server runs stock")
    assert r.stderr == f"kvplugin: {said}\n"


def test_rapid_mlx_is_declared_triggered_and_listed(capsys):
    assert RAPID_MLX in UNSUPPORTED_HOSTS
    assert _bootstrap.TRIGGERS[RAPID_MLX.trigger_module] == "kvplugin.hosts.unsupported"
    assert RAPID_MLX.trigger_module in _bootstrap.STOCK_MAIN
    adapter = get_adapter("rapid-mlx")
    assert adapter is unsupported.RAPID_MLX
    assert (adapter.name, adapter.distribution, adapter.trigger_module) == (
        RAPID_MLX.name, RAPID_MLX.distribution, RAPID_MLX.trigger_module)
    assert str(adapter.supported) == "none" and "0.16.10" not in adapter.supported
    assert cli.main(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  rapid-mlx "))
    assert line.endswith("supported range: none")
    installed = importlib.metadata.distributions(name="rapid-mlx")
    assert ("UNSUPPORTED: runs stock" in line) == any(True for _ in installed)


def test_the_recognized_line_is_said_once_per_process(capsys):
    module = types.ModuleType(RAPID_MLX.trigger_module)
    unsupported.on_import(module)
    unsupported.on_import(module)
    err = capsys.readouterr().err
    assert err.count("kvplugin:") == 1 and "rapid-mlx" in err and "runs stock" in err
