"""Key names of the remote tier: a namespace per (checkpoint, entry format), block-chained
prefix pointers, one value per entry.

Why block-chained pointers (as LMCache chains its chunk hashes): the longest stored prefix of
a prompt must be found in a constant number of round trips, not one request per candidate
length. Every ``block`` tokens of a stored entry get a pointer key whose name is the chained
hash of the tokens up to there and whose value names the entry. A lookup computes the same
chain for the prompt and reads every pointer in one ``MGET``; the deepest one that exists
names an entry sharing at least that many tokens, which a second round trip reads. The entry
carries its tokens, so the hit then covers every common token, not only whole blocks.

Why not one key per stored chunk (LMCache's layout): kvplugin's entries are whole host caches
(rotating, recurrent and MLA layers included) whose layers cannot all be cut into chunks and
glued back; one value per entry keeps every layer kind and codec the SSD tier already stores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvplugin.cache.store.index import tokens_bytes

__all__ = ["PREFIX", "Namespace", "block_ends", "namespace_of"]

#: Every key kvplugin writes starts with this (``redis-cli --scan --pattern 'kvp1:*'``).
PREFIX = "kvp1"


def shared_model_key(model_key: str) -> str:
    """The part of the store's model key that identifies what an entry fits.

    The store's key is ``host|fingerprint|max_kv=N`` (``session.store_key``); the host is
    dropped here so that mlx-lm and vllm-mlx replicas of one checkpoint share entries (both
    hold mlx-lm cache classes, and every fetched entry is validated against the model)."""
    host, sep, rest = str(model_key).partition("|")
    return rest if sep else host


def namespace_of(model_key: str, entry_format: str) -> str:
    """``kvp1:<16 hex>``: entries of other checkpoints, bounds or codec settings never mix."""
    h = hashlib.blake2b(digest_size=8)
    h.update(shared_model_key(model_key).encode())
    h.update(b"\0")
    h.update(entry_format.encode())
    return f"{PREFIX}:{h.hexdigest()}"


def block_ends(n_tokens: int, block: int) -> range:
    """Token counts at which pointers exist: ``block, 2*block, ... <= n_tokens``."""
    return range(block, n_tokens + 1, block)


class Namespace:
    """Key names inside one namespace."""

    def __init__(self, model_key: str, entry_format: str, block: int) -> None:
        self.name = namespace_of(model_key, entry_format)
        self.block = block

    def pointer_keys(self, tokens: Sequence[int]) -> list[tuple[int, str]]:
        """``(n, key)`` for every block end of ``tokens``: ``key`` names ``tokens[:n]`` by
        its chained hash (each block's hash covers the previous one: a pointer can only
        match a prompt that agrees on every token before it)."""
        out = []
        chain = b""
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hashlib.blake2b(chain, digest_size=16)
            h.update(tokens_bytes(tokens[start:start + self.block]))
            chain = h.digest()
            out.append((start + self.block, f"{self.name}:p:{chain.hex()}"))
        return out

    def entry_key(self, tokens: Sequence[int]) -> str:
        """The value key of an entry holding exactly ``tokens``."""
        h = hashlib.blake2b(tokens_bytes(tokens), digest_size=20)
        return f"{self.name}:e:{h.hexdigest()}"
