"""What a host adapter patches in: every function marked by ``wraps_original``, so the host's
original stays reachable from the patch (``__kvplugin_original__``)."""

from __future__ import annotations

import types
from typing import Any


def unmarked(registry: Any) -> list[str]:
    """The patched-in functions of ``registry`` (a ``PatchRegistry``) that no
    ``wraps_original`` marked, as ``owner.name``."""
    out = []
    for p in registry.patches:
        new = vars(p.owner)[p.name]
        fn = new.__func__ if isinstance(new, (classmethod, staticmethod)) else new
        if isinstance(fn, types.FunctionType) and not hasattr(fn, "__kvplugin_original__"):
            out.append(f"{getattr(p.owner, '__name__', p.owner)}.{p.name}")
    return out
