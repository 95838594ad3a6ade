"""Default trim: cut an entry to its used tokens before it is stored.

It consumes the entry (layers replaced in the list as they are cut): the host handed the
entry over, and freeing each oversized layer at once keeps the transient to one layer.
"""

from __future__ import annotations

from kvplugin.hookspecs import hookimpl


@hookimpl(trylast=True)
def kvplugin_trim_entry(cache: list) -> list | None:
    from kvplugin.cache.layers.trim import trim_entry

    return trim_entry(cache, consume=True)  # a stored entry is the store's to change
