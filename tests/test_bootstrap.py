"""Activation through the installed ``kvplugin.pth``, in fresh interpreters.

A fake host package (``fakehost``, distribution version set per test) and a fake adapter
module are written to a temp dir; the real bootstrap finder, installed by the .pth at
interpreter start, must patch it on import, or leave it stock and say why once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ADAPTER = """
from packaging.specifiers import SpecifierSet
from kvplugin.hosts.base import HostAdapter

class FakeAdapter(HostAdapter):
    name = "fakehost"
    distribution = "fakehost"
    supported = SpecifierSet(">=1.0,<2")
    trigger_module = "fakehost.server"

    def apply(self, module, patches):
        if getattr(module, "BREAK_ADAPTER", False):
            raise RuntimeError("seam moved")
        patches.replace(module, "VALUE", "patched")
        import fakehost
        fakehost.INSTALLS = getattr(fakehost, "INSTALLS", 0) + 1

ADAPTER = FakeAdapter()

def on_import(module):
    ADAPTER.install(module)
"""


def make_fake_host(root: Path, version: str, *, broken: bool = False) -> None:
    pkg = root / "fakehost"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text(f"VALUE = 'stock'\nBREAK_ADAPTER = {broken}\n")
    dist = root / f"fakehost-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakehost\nVersion: {version}\n")
    (root / "fake_adapter.py").write_text(textwrap.dedent(ADAPTER))


DRIVER = """
import sys
import kvplugin._bootstrap as b
b.TRIGGERS["fakehost.server"] = "fake_adapter"
import fakehost.server
import importlib; importlib.reload  # noqa
print("VALUE=" + fakehost.server.VALUE)
import fakehost
print("INSTALLS=" + str(getattr(fakehost, "INSTALLS", 0)))
print("HOSTS_IMPORTED=" + str("kvplugin.hosts" in sys.modules))
"""


def run_python(code: str, root: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGIN_")}
    if root is not None:
        full_env["PYTHONPATH"] = str(root)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=60
    )


def parse(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_pth_is_installed_and_activates():
    r = run_python("import sys; print(sum(getattr(f, '_kvplugin_trigger_finder', False) "
                   "for f in sys.meta_path))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1", "kvplugin.pth did not run: is kvplugin installed?"


def test_nothing_heavy_imported_at_start():
    heavy = ["pluggy", "pydantic", "pydantic_settings", "mlx", "mlx.core", "kvplugin.hosts",
             "kvplugin.settings", "kvplugin.plugins", "packaging", "mlx_lm", "vllm_mlx"]
    r = run_python(f"import sys; print([m for m in {heavy!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert r.stderr == ""


def test_supported_host_is_patched_on_import(tmp_path):
    make_fake_host(tmp_path, "1.4")
    r = run_python(DRIVER, tmp_path)
    assert r.returncode == 0, r.stderr
    out = parse(r.stdout)
    assert out["VALUE"] == "patched" and out["INSTALLS"] == "1"
    assert r.stderr == ""


def test_disabled_by_env_leaves_host_stock_and_says_so_once(tmp_path):
    make_fake_host(tmp_path, "1.4")
    code = DRIVER + "\nimport importlib, sys\nsys.modules.pop('fakehost.server')\n" \
                    "import fakehost.server\n"
    r = run_python(code, tmp_path, KVPLUGIN_DISABLE="1")
    assert r.returncode == 0, r.stderr
    out = parse(r.stdout)
    assert out["VALUE"] == "stock" and out["INSTALLS"] == "0"
    assert out["HOSTS_IMPORTED"] == "False"
    assert r.stderr.count("kvplugin:") == 1 and "KVPLUGIN_DISABLE" in r.stderr


def test_unsupported_version_warns_once_and_stays_stock(tmp_path):
    make_fake_host(tmp_path, "0.9")
    r = run_python(DRIVER, tmp_path)
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout)["VALUE"] == "stock"
    assert r.stderr.count("kvplugin:") == 1
    assert "fakehost 0.9 is outside kvplugin's supported range" in r.stderr


def test_adapter_error_never_breaks_the_host_import(tmp_path):
    make_fake_host(tmp_path, "1.4", broken=True)
    r = run_python(DRIVER, tmp_path)
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout)["VALUE"] == "stock"
    assert r.stderr.count("kvplugin:") == 1 and "seam moved" in r.stderr


def test_running_twice_is_harmless(tmp_path):
    make_fake_host(tmp_path, "1.4")
    import site
    site_dir = next(p for p in site.getsitepackages() if (Path(p) / "kvplugin.pth").exists())
    code = (
        "import site, kvplugin._bootstrap as b\n"
        f"site.addsitedir({site_dir!r}); b.activate(); b.activate()\n"
        "import sys\n"
        "print('FINDERS=' + str(sum(getattr(f, '_kvplugin_trigger_finder', False) "
        "for f in sys.meta_path)))\n" + DRIVER
    )
    r = run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    out = parse(r.stdout)
    assert out["FINDERS"] == "1" and out["VALUE"] == "patched" and out["INSTALLS"] == "1"


def test_start_file_names_a_callable():
    """PEP 829: kvplugin.start holds 'pkg.mod:callable' for Python >= 3.15."""
    import site
    site_dir = next(Path(p) for p in site.getsitepackages() if (Path(p) / "kvplugin.pth").exists())
    target = (site_dir / "kvplugin.start").read_text().strip()
    module, _, attr = target.partition(":")
    import importlib
    assert callable(getattr(importlib.import_module(module), attr))


@pytest.mark.parametrize("var", ["0", "false", ""])
def test_disable_only_for_true_values(tmp_path, var):
    make_fake_host(tmp_path, "1.4")
    r = run_python(DRIVER, tmp_path, KVPLUGIN_DISABLE=var)
    assert parse(r.stdout)["VALUE"] == "patched"


def test_python_dash_m_host_module_runs_the_patched_main(tmp_path):
    """``python -m fakehost.server`` runs the *patched* module's main(), like the console
    script (it used to run stock with one line saying so)."""
    make_fake_host(tmp_path, "1.4")
    with (tmp_path / "fakehost" / "server.py").open("a") as fh:
        fh.write("def main():\n    print('VALUE=' + VALUE)\n"
                 "if __name__ == '__main__':\n    main()\n")
    code = ("import runpy, kvplugin._bootstrap as b\n"
            "b.TRIGGERS['fakehost.server'] = 'fake_adapter'\n"
            "runpy.run_module('fakehost.server', run_name='__main__', alter_sys=True)\n")
    r = run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout)["VALUE"] == "patched"
    r = run_python(code, tmp_path, KVPLUGIN_DISABLE="1")  # disabled: the module's own code
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout)["VALUE"] == "stock"


def test_python_dash_m_without_main_runs_stock_and_says_so(tmp_path):
    make_fake_host(tmp_path, "1.4")
    (tmp_path / "fakehost" / "server.py").write_text("print('VALUE=stock-main')\n")
    code = ("import runpy, kvplugin._bootstrap as b\n"
            "b.TRIGGERS['fakehost.server'] = 'fake_adapter'\n"
            "runpy.run_module('fakehost.server', run_name='__main__', alter_sys=True)\n")
    r = run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "VALUE=stock-main" in r.stdout and "has no main()" in r.stderr


def test_a_plugin_host_registers_its_trigger(tmp_path):
    """A third host's own .pth line: ``kvplugin._bootstrap.register(trigger, adapter)``."""
    make_fake_host(tmp_path, "1.4")
    code = DRIVER.replace('b.TRIGGERS["fakehost.server"] = "fake_adapter"',
                          'b.register("fakehost.server", "fake_adapter")')
    r = run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    out = parse(r.stdout)
    assert out["VALUE"] == "patched" and out["INSTALLS"] == "1"


def test_registering_an_already_imported_host_patches_it(tmp_path):
    make_fake_host(tmp_path, "1.4")
    code = ("import fakehost.server, kvplugin._bootstrap as b\n"
            "assert fakehost.server.VALUE == 'stock'\n"
            "b.register('fakehost.server', 'fake_adapter')\n"
            "print('VALUE=' + fakehost.server.VALUE)\n")
    r = run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout)["VALUE"] == "patched"


def test_triggers_are_the_declared_hosts():
    from kvplugin import _bootstrap
    from kvplugin.hostspecs import BUILTIN_HOSTS

    for decl in BUILTIN_HOSTS:
        assert _bootstrap.TRIGGERS[decl.trigger_module] == decl.adapter_module
