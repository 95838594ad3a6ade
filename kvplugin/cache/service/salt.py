"""A request's ``cache_salt`` (vLLM's request field): a namespace of its own in every tier.

Why: when prefixes are shared across users, prompt-cache timing tells one user what another
sent ("Auditing Prompt Caching in Language Model APIs"); vLLM added ``cache_salt`` for this and
LMCache puts it in its keys. kvplugin folds the salt, hashed, into the store's model key, the
one name every tier keys by: the hot index and its lent snapshots, the recent-prompt
bookkeeping, the SSD tier's directory names and the remote tier's Redis namespace. Two salts
never share a prefix anywhere, and a salt is never written anywhere in clear. A request
without a salt keeps the key it always had (existing SSD directories and Redis keys stay
valid).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

__all__ = ["FIELD", "SaltRefused", "salt_of", "salted_key"]

#: The request body's field (vLLM's name, which clients already send).
FIELD = "cache_salt"
_PERSON = b"kvplugin-salt"  # blake2b personalisation: these digests mean nothing elsewhere


class SaltRefused(ValueError):
    """A request refused for its ``cache_salt`` (HTTP 400); the message names the field."""


def salt_of(body: Any, *, required: bool) -> str | None:
    """The request's salt from its JSON ``body``; None: the request has none.

    A salt must be a non-empty string (vLLM's rule). ``required`` (``--kv-cache-require-salt``):
    a request without one is refused, so that no tenant's prompts land in the shared
    namespace by a client's oversight.
    """
    value = body.get(FIELD) if isinstance(body, Mapping) else None
    if value is None:
        if required:
            raise SaltRefused(
                f"'{FIELD}' is required: this server keeps every tenant's prompt cache apart "
                f"(--kv-cache-require-salt); send a non-empty string unique to the tenant")
        return None
    if not isinstance(value, str) or not value:
        raise SaltRefused(f"'{FIELD}' must be a non-empty string")
    return value


def salted_key(model_key: str, salt: str | None) -> str:
    """``model_key`` as a request with ``salt`` sees it: unchanged without a salt, else with
    a 128-bit digest of the salt appended (the salt itself is never part of a name)."""
    if salt is None:
        return model_key
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16,
                             person=_PERSON).hexdigest()
    return f"{model_key}|salt={digest}"
