"""Restart persistence: a host's shut-down save and start-up load, through the backend hook.

Why apart from the front desk: it is the one part of :class:`KVService` that reaches a disk
on the host's own directory (not the configured tiers), and never under ``hot_cache_only``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvplugin.cache.tiers.shutdown import ShutdownOnlyTier

__all__ = ["PERSIST_SUBDIR", "Persistence", "persist_dir"]


class Persistence:
    """What :class:`~kvplugin.cache.service.service.KVService` does across restarts (a
    mixin: it reads the service's ``settings``, ``store``, ``hook`` and ``_lock``)."""

    def may_persist(self) -> bool:
        """Whether anything of the prompt cache may reach a disk (not under hot_cache_only)."""
        return not self.settings.hot_cache_only

    def _tier_at(self, directory: Path) -> Any:
        """The backend hook's cold tier on a host's persistence directory."""
        settings = self.settings.model_copy(update={"ssd_cache_dir": Path(directory)})
        return self.hook.kvplugin_store_backend(settings=settings)

    def reload(self, directory: str | os.PathLike) -> int:
        """A host's start-up load: the previous run's entries become a (read-only until
        :meth:`persist`) cold tier, read lazily on the first hit. Returns how many."""
        if not self.may_persist():
            return 0
        with self._lock:
            if self.store.cold is None:
                if not Path(directory).is_dir():
                    return 0
                tier = self._tier_at(Path(directory))
                if tier is None:
                    return 0
                self.store.attach_cold(ShutdownOnlyTier(tier))
            cold = self.store.cold
        try:
            return len(cold)
        except TypeError:
            return 0

    def persist(self, directory: str | os.PathLike) -> bool:
        """A host's shut-down save: spill every hot entry to the cold tier (the configured
        one, else one on ``directory``). True if an entry was written."""
        if not self.may_persist():
            return False
        with self._lock:
            if self.store.cold is None:
                if len(self.store) == 0:
                    return False
                tier = self._tier_at(Path(directory))
                if tier is None:
                    return False
                self.store.attach_cold(ShutdownOnlyTier(tier))
            cold = self.store.cold
            if isinstance(cold, ShutdownOnlyTier):
                cold.accept_puts = True
        try:
            return self.store.flush()
        finally:
            if isinstance(cold, ShutdownOnlyTier):
                cold.accept_puts = False

    def flush_configured(self) -> bool:
        """Spill the hot entries to a configured cold tier (``--ssd-cache-dir``) at an engine
        stop, so they survive a restart. Not to a persistence tier (that is :meth:`persist`)."""
        if isinstance(self.store.cold, ShutdownOnlyTier):
            return False
        return self.store.flush()


#: kvplugin's files go under this subdirectory of a host's persistence directory.
PERSIST_SUBDIR = "kvplugin"


def persist_dir(host_dir: str | os.PathLike) -> Path:
    """Where kvplugin persists under a host's prefix-cache directory: a subdirectory of its
    own, so kvplugin's files never mix with the host's (each would misread the other's)."""
    return Path(host_dir).expanduser() / PERSIST_SUBDIR
