"""Token-key index: a radix trie per model plus one LRU order, shared by every tier.

Why one index: the hot tier and the SSD tier answer the same question (the longest stored
prefix of a request, or failing that an entry sharing its first tokens) and keep the same
recency order. :class:`KeyIndex` holds values (a
hot entry, an SSD file record) under ``(namespace, token tuple)`` and knows their sizes, so a
tier only decides what a value *is* and what happens to it.

Pure Python: no mlx, nothing of the engine.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

__all__ = ["KeyIndex", "MAX_COPY_CANDIDATES", "PrefixTrie", "choose", "to_key", "tokens_bytes"]

#: How many entries below a divergence point a fetch asks for a copy (bounds a lookup's cost)
MAX_COPY_CANDIDATES = 8


def to_key(tokens: Iterable[int] | Any) -> tuple:
    """Token sequence (list, tuple, ``mx.array``, numpy array) -> tuple of ints."""
    if not isinstance(tokens, (list, tuple)) and hasattr(tokens, "tolist"):
        tokens = tokens.reshape(-1).tolist() if hasattr(tokens, "reshape") else tokens.tolist()
    return tuple(map(int, tokens))


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int64 bytes: what an entry's name (SSD file, Redis key) is a
    hash of, so that the same tokens name the same entry on every machine."""
    a = array("q", tokens)
    if sys.byteorder == "big":  # pragma: no cover - every platform MLX runs on is little
        a.byteswap()
    return a.tobytes()


# ------------------------------------------------------------------- radix trie


class _Node:
    __slots__ = ("edge", "children", "value")

    def __init__(self, edge: tuple = ()):
        self.edge = edge
        self.children: dict = {}
        self.value = None


def _common(edge: tuple, key: tuple, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[pos:]``."""
    n = min(len(edge), len(key) - pos)
    if key[pos : pos + n] == edge[:n]:
        return n
    i = 0
    step = 256
    while i + step <= n and key[pos + i : pos + i + step] == edge[i : i + step]:
        i += step
    while i < n and key[pos + i] == edge[i]:
        i += 1
    return i


class PrefixTrie:
    """Radix trie mapping token tuples to values; all operations O(len(key)).

    Compact invariant: every non-root node without a value has >= 2 children.
    """

    def __init__(self):
        self.root = _Node()
        self.size = 0

    def __len__(self):
        return self.size

    def insert(self, key: tuple, value):
        """Set ``key`` to ``value``; return the previous value (or None)."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:])
                node.children[key[pos]] = leaf
                node, pos = leaf, len(key)
                break
            m = _common(child.edge, key, pos)
            if m < len(child.edge):  # split the edge
                mid = _Node(child.edge[:m])
                child.edge = child.edge[m:]
                mid.children[child.edge[0]] = child
                node.children[key[pos]] = mid
                child = mid
            node, pos = child, pos + m
        old = node.value
        node.value = value
        if old is None:
            self.size += 1
        return old

    def _path(self, key: tuple):
        path, node, pos = [self.root], self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None or _common(child.edge, key, pos) < len(child.edge):
                return None
            node, pos = child, pos + len(child.edge)
            path.append(node)
        return path

    def get(self, key: tuple):
        path = self._path(key)
        return None if path is None else path[-1].value

    def remove(self, key: tuple):
        """Remove ``key``; return its value (None if absent)."""
        path = self._path(key)
        if path is None or path[-1].value is None:
            return None
        node = path[-1]
        value, node.value = node.value, None
        self.size -= 1
        if len(path) >= 2:
            self._compact(path[-2], node)
        if len(path) >= 3:
            self._compact(path[-3], path[-2])
        return value

    @staticmethod
    def _compact(parent: _Node, node: _Node):
        if node.value is not None or parent.children.get(node.edge[0]) is not node:
            return
        if not node.children:
            del parent.children[node.edge[0]]
        elif len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            parent.children[node.edge[0]] = child

    def search(self, key: tuple):
        """Walk ``key``.  Returns ``(prefixes, deep_len, deep_node, deep_self)``:
        ``prefixes`` = [(length, value)] for stored keys that are prefixes of
        ``key`` (shortest first); every value in ``deep_node``'s subtree (itself
        included iff ``deep_self``) that is not in ``prefixes`` shares exactly
        ``deep_len`` leading tokens with ``key`` (or extends ``key`` when
        ``deep_len == len(key)``)."""
        prefixes = []
        node, pos = self.root, 0
        while True:
            if node.value is not None:
                prefixes.append((pos, node.value))
            if pos == len(key):
                return prefixes, pos, node, False
            child = node.children.get(key[pos])
            if child is None:
                return prefixes, pos, node, False
            m = _common(child.edge, key, pos)
            if m < len(child.edge):
                return prefixes, pos + m, child, True
            node, pos = child, pos + m

    @staticmethod
    def below(node: _Node, include_self: bool, limit: int) -> Iterator:
        """Up to ``limit`` values in ``node``'s subtree, shortest keys first (stock picks the
        shortest longer entry): the first may not be able to give the prefix (a chunked
        layer trimmed at its front), a shorter turn of the same conversation often can."""
        count = itertools.count()
        heap = [(0, next(count), node)] if include_self else [
            (len(c.edge), next(count), c) for c in node.children.values()]
        heapq.heapify(heap)
        while heap and limit > 0:
            depth, _, x = heapq.heappop(heap)
            if x.value is not None:
                limit -= 1
                yield x.value
            for c in x.children.values():
                heapq.heappush(heap, (depth + len(c.edge), next(count), c))

    def prefixes_of(self, key: tuple):
        """[(length, value)] of stored strict prefixes of ``key``."""
        prefixes, *_ = self.search(key)
        return [(n, v) for n, v in prefixes if n < len(key)]

    def branches(self, key: tuple):
        """[(common, value)] of stored keys that diverge from ``key`` (neither a prefix of it
        nor an extension), with the number of leading tokens each shares with ``key``."""
        out: list = []

        def collect(node: _Node, common: int) -> None:
            stack = [node]
            while stack:
                x = stack.pop()
                if x.value is not None:
                    out.append((common, x.value))
                stack.extend(x.children.values())

        node, pos = self.root, 0
        while pos < len(key):
            for first, child in node.children.items():
                if first != key[pos]:
                    collect(child, pos)
            child = node.children.get(key[pos])
            if child is None:
                break
            m = _common(child.edge, key, pos)
            if m < len(child.edge):
                if pos + m < len(key):
                    collect(child, pos + m)
                break
            node, pos = child, pos + m
        return out


def choose(trie: PrefixTrie, key: tuple, *, trimmable, copyable):
    """Pick the best candidate for a request (shared by hot and cold tiers).

    ``trimmable(value) -> bool``; ``copyable(value, n) -> bool``.  Returns None or
    ``(mode, value, n)`` with mode "move" (value's key is a prefix of ``key``; if
    its length equals ``len(key)`` the caller must trim one token) or "copy" (copy
    the first ``n`` positions).  ``1 <= n <= len(key) - 1`` always.
    """
    cap = len(key) - 1
    if cap < 1:
        return None
    prefixes, deep_len, deep_node, deep_self = trie.search(key)
    best = None
    for plen, value in reversed(prefixes):
        if plen <= cap:
            best = ("move", value, plen)
            break
        if trimmable(value):  # exact match: move it and trim one token
            best = ("move", value, cap)
            break
    n = min(deep_len, cap)
    if n >= 1 and n > (best[2] if best else 0):
        for value in PrefixTrie.below(deep_node, deep_self, limit=MAX_COPY_CANDIDATES):
            if copyable(value, n):
                return "copy", value, n
        # None can be cut there (a chunked layer trimmed at its front): an entry that
        # diverges earlier may still give a shorter cut, as an earlier turn often does.
        shared = sorted(trie.branches(key), key=lambda cv: -cv[0])[:MAX_COPY_CANDIDATES]
        for common, value in shared:
            m = min(common, cap)
            if m <= (best[2] if best else 0):
                break
            if copyable(value, m):
                return "copy", value, m
    return best


# ------------------------------------------------------------------- trie + LRU


class KeyIndex:
    """Values under ``(namespace, tokens)``: one trie per namespace, one LRU over all.

    ``size(value)`` prices a value; :attr:`nbytes` is the sum over stored values. Not
    thread-safe: each tier calls it under its own lock.
    """

    def __init__(self, size: Callable[[Any], int]) -> None:
        self._size = size
        self._tries: dict[Hashable, PrefixTrie] = {}
        self._lru: OrderedDict = OrderedDict()  # (namespace, key) -> value
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def values(self) -> list:
        """Values, least recently used first."""
        return list(self._lru.values())

    def oldest(self) -> Any:
        return next(iter(self._lru.values()), None)

    def get(self, namespace: Hashable, key: tuple) -> Any:
        return self._lru.get((namespace, key))

    def add(self, namespace: Hashable, key: tuple, value: Any) -> Any:
        """Store ``value`` as most recently used; return the value it replaced (or None)."""
        trie = self._tries.get(namespace)
        if trie is None:
            trie = self._tries[namespace] = PrefixTrie()
        old = trie.insert(key, value)
        if old is not None:
            self._lru.pop((namespace, key), None)
            self.nbytes -= self._size(old)
        self._lru[(namespace, key)] = value
        self.nbytes += self._size(value)
        return old

    def remove(self, namespace: Hashable, key: tuple) -> Any:
        """Forget ``key``; return its value (None if absent)."""
        value = self._lru.pop((namespace, key), None)
        if value is None:
            return None
        trie = self._tries.get(namespace)
        if trie is not None:
            trie.remove(key)
            if not trie.size:
                del self._tries[namespace]
        self.nbytes -= self._size(value)
        return value

    def reprice(self, value: Any, change: Callable[[Any], None]) -> None:
        """Apply ``change`` to a stored ``value`` that alters its price, keeping its place."""
        self.nbytes -= self._size(value)
        change(value)
        self.nbytes += self._size(value)

    def touch(self, namespace: Hashable, key: tuple) -> None:
        """Make ``key`` most recently used."""
        self._lru.move_to_end((namespace, key))

    def prefixes_of(self, namespace: Hashable, key: tuple) -> list:
        """[(length, value)] of stored strict prefixes of ``key``."""
        trie = self._tries.get(namespace)
        return trie.prefixes_of(key) if trie is not None else []

    def branches(self, namespace: Hashable, key: tuple) -> list:
        """:meth:`PrefixTrie.branches` within one namespace."""
        trie = self._tries.get(namespace)
        return trie.branches(key) if trie is not None else []

    def choose(self, namespace: Hashable, key: tuple, *, trimmable: Callable[[Any], bool],
               copyable: Callable[[Any, int], bool]) -> tuple | None:
        """:func:`choose` within one namespace."""
        trie = self._tries.get(namespace)
        if trie is None:
            return None
        return choose(trie, key, trimmable=trimmable, copyable=copyable)

    def clear(self) -> None:
        self._tries.clear()
        self._lru.clear()
        self.nbytes = 0

    def __iter__(self) -> Iterator:
        return iter(self.values())
