"""Default trim: cut an entry to its used tokens before it is stored."""

from __future__ import annotations

from kvplugin.hookspecs import hookimpl


@hookimpl(trylast=True)
def kvplugin_trim_entry(cache: list) -> list | None:
    from kvplugin.cache.trim import trim_entry

    return trim_entry(cache)
