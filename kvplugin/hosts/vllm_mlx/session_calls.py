"""Decisions the vllm-mlx adapter used to make inline, now asked of one place each.

Why here and not in :mod:`kvplugin.cache.session`: they are engine policy and belong on
:class:`~kvplugin.cache.session.KVService` (or beside :func:`~kvplugin.cache.session.
model_problem`), but that module is being reworked in parallel. Each function is written
as the session call it should become (settings in, decision out, no host types), so moving
it is a cut and paste; until then the adapter calls it here and never decides inline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: kvplugin's files go under this subdirectory of a host's persistence directory.
PERSIST_SUBDIR = "kvplugin"


def store_key(host: str, fingerprint: str, settings: Any) -> str:
    """The store's model key for a checkpoint ``fingerprint`` served under ``settings``.

    The bound is part of the key: an entry built under another ``--max-kv-size`` (a rotating
    cache that dropped tokens, or an unbounded one) must not be served to this process, even
    from a persisted cold tier.
    """
    bound = (settings.max_kv_size if settings is not None else None) or 0
    return f"{host}|{fingerprint}|max_kv={bound}"


def persist_dir(host_dir: str | os.PathLike) -> Path:
    """Where kvplugin persists under a host's prefix-cache directory: a subdirectory of its
    own, so kvplugin's files never mix with the host's (each would misread the other's)."""
    return Path(host_dir).expanduser() / PERSIST_SUBDIR


def unpatched_problem(settings: Any, host: str) -> str | None:
    """Why the host must not start when kvplugin could not patch its serving path, or None.

    Serving stock is acceptable (the user gets the host's own cache) except under
    ``--hot-cache-only``: a stock host would write its prompt cache to disk, the one thing
    that flag promises will not happen. Fail closed.
    """
    if settings is not None and settings.hot_cache_only:
        return (
            "kvplugin: --hot-cache-only (KVPLUGIN_HOT_CACHE_ONLY) cannot be honoured "
            f"because kvplugin could not patch {host} (see above); not starting"
        )
    return None
