"""Shared fixtures: every test starts with no KVPLUGIN_* variables and a fresh manager."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_kvplugin_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVPLUGIN_"):
            monkeypatch.delenv(name)
    from kvplugin import log, plugins

    plugins.reset_plugin_manager()
    log.forget()
    yield
    plugins.reset_plugin_manager()
