"""Where kvplugin keeps what it builds locally (models).

A leaf module (stdlib only) so that both the runtime (``kvplugin info``) and the model
builders under ``kvplugin.tools`` can ask for the path without the runtime importing tools.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["kvplugin_home"]


def kvplugin_home() -> Path:
    """Where kvplugin keeps what it builds locally (models): ``$KVPLUGIN_HOME``, else
    ``$XDG_CACHE_HOME/kvplugin`` (``~/.cache/kvplugin`` by default)."""
    home = os.environ.get("KVPLUGIN_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvplugin"
