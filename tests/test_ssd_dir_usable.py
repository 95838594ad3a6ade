"""``--ssd-cache-dir`` is tried at settings time (created? listed? written?) and nothing is
left behind; a directory that refuses writes is a read-only tier, one the tier cannot use at
all is a SettingsError naming the flag, the variable and the value as the user gave it."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest

from kvplugin.resources import usable_directory
from kvplugin.settings import SettingsError, resolve_settings


def _refusal(monkeypatch, where: str, code: int) -> None:
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile if where == "mkstemp" else os, where, refuse)


def test_missing_is_creatable_and_not_created(tmp_path):
    target = tmp_path / "a" / "b"
    assert usable_directory(target) is True
    assert list(tmp_path.iterdir()) == []  # the probe directory is gone too


def test_existing_writable_leaves_nothing(tmp_path):
    assert usable_directory(tmp_path) is True
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EPERM])
def test_refused_writes_make_a_read_only_tier(tmp_path, monkeypatch, code):
    _refusal(monkeypatch, "mkstemp", code)
    assert usable_directory(tmp_path) is False


def test_a_full_disk_is_the_tiers_business(tmp_path, monkeypatch):
    _refusal(monkeypatch, "mkstemp", errno.ENOSPC)
    assert usable_directory(tmp_path) is True


def test_other_write_errors_and_unlistable_are_errors(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        _refusal(m, "mkstemp", errno.EIO)
        with pytest.raises(ValueError, match="cannot be written"):
            usable_directory(tmp_path)
    _refusal(monkeypatch, "listdir", errno.EACCES)
    with pytest.raises(ValueError, match="cannot be read: Permission denied"):
        usable_directory(tmp_path)


def test_files_links_and_proc(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        usable_directory(tmp_path / "f")
    with pytest.raises(ValueError, match=f"{tmp_path / 'f'} is not a directory"):
        usable_directory(tmp_path / "f" / "sub")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="symbolic link to nothing"):
        usable_directory(tmp_path / "dangling")
    with pytest.raises(ValueError, match="cannot be created: .* in /proc"):
        usable_directory("/proc/kvplugin-test/kv")


def test_settings_name_flag_variable_and_value(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SettingsError) as exc:
        resolve_settings({"ssd_cache_dir": tmp_path / "f"})  # a Path, as argparse gives it
    msg = str(exc.value)
    assert "--ssd-cache-dir / KVPLUGIN_SSD_CACHE_DIR" in msg and "not a directory" in msg
    assert f"got --ssd-cache-dir '{tmp_path / 'f'}'" in msg  # not PosixPath(...)
    monkeypatch.setenv("KVPLUGIN_SSD_CACHE_DIR", "/proc/kvplugin-test/kv")
    with pytest.raises(SettingsError, match="got KVPLUGIN_SSD_CACHE_DIR='/proc/kvplugin-test/kv'"):
        resolve_settings()


def test_not_tried_under_hot_cache_only(monkeypatch):
    # the directory is not used (a notice says so): a launch script that always names one
    # must not stop a server started with --hot-cache-only
    monkeypatch.setenv("KVPLUGIN_SSD_CACHE_DIR", "/proc/kvplugin-test/kv")
    s = resolve_settings({"hot_cache_only": True})
    assert s.cold_tier_dir is None
