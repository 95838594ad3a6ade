"""Key names of the remote tier and what its pointer keys hold: a namespace per (checkpoint,
entry format), block-chained pointer sets, one value per entry.

Why block-chained pointers (as LMCache chains its chunk hashes): the stored entries that share
a prompt's first tokens must be found in a constant number of round trips, not one request per
candidate length. Every ``block`` tokens of a stored entry get a pointer key whose name is the
chained hash of the tokens up to there; a lookup computes the same chain for the prompt and
reads every pointer in one pipelined round trip.

Why each pointer is a small set of candidates and not one entry's name: one block holds the
ends of many entries (a system prompt, each conversation's prompt, prompt + reply) and leads
to the longer ones that pass it; which one serves a prompt best depends on the prompt. So a
pointer is a sorted set of at most :data:`FAN_OUT` members, newest first, each naming one
entry with what choosing needs: its length, the fewest tokens it can be cut to (none for
recurrent state or a wrapped window), its value's size, and a one-byte fingerprint of each of
its tokens from the pointer up to the next block end. From those a reader knows locally, for
every candidate, how many tokens it shares with the prompt: where it diverges, or that its
whole key starts the prompt (checked against the entry's name, a hash of its tokens). It
picks as the hot tier does (:func:`kvplugin.cache.store.index.choose`): the entry that gives the
most tokens, whole if it can, and reads only that one.

Why not one key per stored chunk (LMCache's layout): kvplugin's entries are whole host caches
(rotating, recurrent and MLA layers included) whose layers cannot all be cut into chunks and
glued back; one value per entry keeps every layer kind and codec the SSD tier already stores.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplugin.cache.store.index import tokens_bytes

__all__ = ["FAN_OUT", "PREFIX", "Candidate", "Choice", "Namespace", "choose", "fingerprints",
           "namespace_of"]

#: Every key kvplugin writes starts with this (``redis-cli --scan --pattern 'kvp2:*'``). It
#: names the layout: a reader of another layout finds nothing under this prefix.
PREFIX = "kvp2"
#: Members a pointer set keeps (the newest): bounds what one lookup reads per block.
FAN_OUT = 8

_DIGEST = 20
_HEAD = struct.Struct(f"<{_DIGEST}sIiQ")  # entry digest, tokens held, copy floor, value bytes


def shared_model_key(model_key: str) -> str:
    """The part of the store's model key that identifies what an entry fits.

    The store's key is ``host|fingerprint|max_kv=N`` (``session.store_key``); the host is
    dropped here so that mlx-lm and vllm-mlx replicas of one checkpoint share entries (both
    hold mlx-lm cache classes, and every fetched entry is validated against the model)."""
    host, sep, rest = str(model_key).partition("|")
    return rest if sep else host


def namespace_of(model_key: str, entry_format: str) -> str:
    """``kvp2:<16 hex>``: entries of other checkpoints, bounds or codec settings never mix."""
    h = hashlib.blake2b(digest_size=8)
    h.update(shared_model_key(model_key).encode())
    h.update(b"\0")
    h.update(entry_format.encode())
    return f"{PREFIX}:{h.hexdigest()}"


def _entry_digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(tokens_bytes(tokens), digest_size=_DIGEST).digest()


def fingerprints(tokens: Sequence[int]) -> bytes:
    """One byte per token, the low byte of its id: where two token runs first differ, their
    fingerprints differ too but about once in 256 (the value read then tells the exact
    count). An eighth of the id's bytes: a lookup reads them for every member it reads."""
    return tokens_bytes(tokens)[::8]  # little-endian int64: the low byte first


@dataclass(frozen=True)
class Candidate:
    """One entry a pointer set names."""

    digest: bytes
    n_tokens: int
    floor: int | None  # fewest tokens it can be cut to; None: served only whole
    size: int  # bytes of its value


def _unpack(member: bytes) -> Candidate | None:
    """The candidate a member names; None when the member is not one this layout writes."""
    if len(member) < _HEAD.size:
        return None
    digest, n, floor, size = _HEAD.unpack_from(member)
    return Candidate(digest, n, None if floor < 1 else floor, size) if -1 <= floor <= n else None


@dataclass
class Choice:
    """The candidate a lookup reads, how many tokens it serves, where it was listed."""

    candidate: Candidate
    n: int  # its whole length when ``whole`` (the store trims one token of a full match)
    whole: bool
    listed: list[tuple[str, bytes]] = field(default_factory=list)  # (pointer key, member)


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

    def value_key(self, digest: bytes) -> str:
        return f"{self.name}:e:{digest.hex()}"

    def entry_key(self, tokens: Sequence[int]) -> str:
        """The value key of an entry holding exactly ``tokens``."""
        return self.value_key(_entry_digest(tokens))

    def members(self, tokens: Sequence[int], floor: int | None,
                size: int) -> list[tuple[str, bytes]]:
        """``(pointer key, member)`` naming the entry of ``tokens`` whose value is ``size``
        bytes and can be cut to any length from ``floor`` (None: only served whole).

        Whole-only, it is listed at its last block end alone (it serves only prompts that
        start with all of it); else at every block end from which a cut it allows is reached.
        """
        digest = _entry_digest(tokens)
        n = len(tokens)
        ends = self.pointer_keys(tokens)
        if floor is None:
            ends = ends[-1:]
        else:
            ends = [(end, p) for end, p in ends if min(n, end + self.block) >= floor]
        head = _HEAD.pack(digest, n, -1 if floor is None else floor, size)
        marks = fingerprints(tokens[ends[0][0]:]) if ends else b""
        start = ends[0][0] if ends else 0
        return [(p, head + marks[end - start:end - start + self.block]) for end, p in ends]


def _shared(tail: bytes, marks: bytes, end: int) -> int:
    """Fingerprints from ``end`` on that ``tail`` shares with the prompt's ``marks``."""
    part = marks[end:end + len(tail)]
    if tail.startswith(part):
        return len(part)
    lo, hi = 0, len(part) - 1  # the longest common prefix, by halving (slices compare in C)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tail[:mid] == part[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _whole(key: tuple, lengths: set[int]) -> dict[int, bytes]:
    """The entry digest of ``key[:n]`` for each ``n``, hashing ``key`` once."""
    data = tokens_bytes(key)
    h = hashlib.blake2b(digest_size=_DIGEST)
    out, done = {}, 0
    for n in sorted(lengths):
        h.update(data[8 * done:8 * n])
        out[n], done = h.copy().digest(), n
    return out


def choose(key: tuple, listed: list[tuple[int, str, list[bytes]]], block: int, *,
           have: int = 0, max_bytes: int | None = None) -> tuple[Choice | None, bool]:
    """The candidate serving the most tokens of ``key`` (more than ``have``), as the hot tier
    chooses: an entry whose whole key is a prefix of ``key`` is served whole; any other is cut
    where it diverges (or one token short of ``key``) if it can be cut there. Ties go to a
    whole entry, then the smaller value, then the newer one.

    ``listed``: ``(end, pointer key, members newest first)`` for the prompt's block ends.
    Returns ``(choice or None, whether a better candidate was over max_bytes)``.
    """
    cap = len(key) - 1
    marks = fingerprints(key)
    seen: dict[bytes, list] = {}  # digest -> [share, candidate, order, listed, listed at]
    for end, pointer, members in listed:
        for member in members:
            entry = seen.get(member[:_DIGEST])
            if entry is None:
                cand = _unpack(member)
                if cand is None:
                    continue
                entry = [0, cand, len(seen), [], end]
            tail = member[_HEAD.size:]
            if len(tail) != min(entry[1].n_tokens, end + block) - end:
                continue  # not this layout's (a tail of another length)
            seen.setdefault(entry[1].digest, entry)
            entry[0] = max(entry[0], end + _shared(tail, marks, end))
            entry[3].append((pointer, member))
            entry[4] = max(entry[4], end)
    # A whole match by fingerprints is checked against the entry's name (a hash of its tokens)
    digests = _whole(key, {e[1].n_tokens for e in seen.values() if e[0] == e[1].n_tokens})
    ranked = []
    for share, cand, newer, where, deepest in seen.values():
        if share == cand.n_tokens and digests[share] != cand.digest:
            share = deepest  # fingerprints that collide: it shares at least its pointer
        n = min(share, cap)
        # a full match of the prompt is served whole too (the store trims its last token)
        whole = share == cand.n_tokens and (share <= cap or cand.floor is not None)
        if n <= have or not whole and (cand.floor is None or cand.floor > n):
            continue
        ranked.append(((n, whole, -cand.size, -newer),
                       Choice(cand, cand.n_tokens if whole else n, whole, where)))
    ranked.sort(key=lambda rc: rc[0], reverse=True)
    for i, (_, choice) in enumerate(ranked):
        if max_bytes is None or choice.candidate.size <= max_bytes:
            return choice, i > 0
    return None, bool(ranked)
