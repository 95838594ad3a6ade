"""The docs are part of the contract: they must agree with the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kvplugin import hookspecs
from kvplugin.settings import KVPluginSettings, option_infos

ROOT = Path(__file__).resolve().parents[1]
HOOKS_MD = (ROOT / "docs" / "hooks.md").read_text()
CONFIG_MD = (ROOT / "docs" / "configuration.md").read_text()
HOOK_NAMES = sorted(n for n in dir(hookspecs) if n.startswith("kvplugin_"))


def config_rows() -> dict[str, list[str]]:
    rows = {}
    for line in CONFIG_MD.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`--"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_configuration_md_lists_exactly_the_settings():
    assert set(config_rows()) == {i.flag for i in option_infos()}


@pytest.mark.parametrize("info", option_infos(), ids=lambda i: i.field)
def test_configuration_md_row_agrees_with_model(info):
    flag, env, _type, default, allowed, _meaning = config_rows()[info.flag]
    assert env == f"`{info.env}`"
    model_default = KVPluginSettings.model_fields[info.field].default
    expected = "none" if model_default is None else str(model_default).lower()
    assert default == f"`{expected}`"
    assert allowed == info.allowed


def test_hook_api_has_hooks():
    assert len(HOOK_NAMES) >= 6


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_documented_with_exact_signature(name):
    section = re.search(rf"^## `{name}`$(.*?)(?=^## |\Z)", HOOKS_MD, re.M | re.S)
    assert section, f"docs/hooks.md has no section '## `{name}`'"
    params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    assert f"{name}({params})" in section.group(1), "signature in docs differs from hookspecs"
    for heading in ("When", "Returns", "Example"):
        assert f"**{heading}**" in section.group(1), f"{name}: missing **{heading}**"


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_is_tested(name):
    """A hook counts as tested when some test (other than this file) calls it."""
    callers = [
        p for p in (ROOT / "tests").glob("test_*.py")
        if p.name != "test_docs.py" and re.search(rf"hook\.{name}\b", p.read_text())
    ]
    assert callers, f"no test calls pm.hook.{name}"
