"""The runtime never imports the tooling: ``kvplugin.tools`` (demo, benchmarks, model
builders, HTTP client) stays out of every host process kvplugin patches.

Every module of ``kvplugin`` outside ``tools/`` and the command line is imported in a fresh
interpreter, which must end with no ``kvplugin.tools`` module loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvplugin

PACKAGE = Path(kvplugin.__file__).resolve().parent
NOT_RUNTIME = {"kvplugin.cli"}  # the command line fronts the tools


def runtime_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if name.startswith("kvplugin.tools") or name in NOT_RUNTIME:
            continue
        names.append(name)
    return names


def test_runtime_modules_are_found():
    names = runtime_modules()
    for expected in ("kvplugin._bootstrap", "kvplugin.hostspecs", "kvplugin.hosts",
                     "kvplugin.hosts.mlx_lm", "kvplugin.settings", "kvplugin.plugins"):
        assert expected in names
    assert any(n.startswith("kvplugin.cache.") for n in names)


def test_importing_the_runtime_never_imports_tools():
    code = (
        "import importlib, sys\n"
        f"for name in {runtime_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvplugin.tools')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_info_finds_the_model_cache_without_tools(tmp_path):
    """``kvplugin info`` is runtime: reporting where models are built loads no tools module."""
    code = (
        "import sys\n"
        "from kvplugin.info import collect\n"
        "print(collect({})['model_cache'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvplugin.tools')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGIN_")}
    env["KVPLUGIN_HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [str(tmp_path / "home"), "[]"]
