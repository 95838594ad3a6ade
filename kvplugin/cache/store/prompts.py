"""Where a stored entry's prompts ended, learnt from the prompts of recent fetches.

Hosts give back a finished cache keyed by prompt + generated tokens without saying where the
prompt ended; every request's prompt went through a fetch first, so the recent prompts that
an entry's tokens start with tell. Two decisions need it: the store lets a conversation's
next turn supersede an entry whose prompt it knows (:meth:`RecentPrompts.prompt_len`), and
the codec keeps the tokens before earlier prompts' ends at full precision, since a repeated or
edited turn reuses exactly such a prefix (:meth:`RecentPrompts.boundaries`). Prompts are
remembered per model key (a request's ``cache_salt`` is part of it): what one tenant sent
never shapes how another's entries are kept.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Sequence

__all__ = ["MAX_PROMPT_BOUNDARIES", "RecentPrompts"]

#: Earlier prompt boundaries an entry keeps full-precision rows before (the latest ones; each
#: costs ``recent`` tokens at full precision, 16 rows by default below 6 bits)
MAX_PROMPT_BOUNDARIES = 8


class RecentPrompts:
    """``(length, last token, hash of key and prompt)`` of the last ``size`` fetched prompts.
    Thread-safe.

    The last token is compared before hashing a prefix (which costs a pass over it: ~0.3 ms
    per 32k tokens), so that prompts of other conversations cost next to nothing."""

    def __init__(self, size: int = 64) -> None:
        self._seen: deque[tuple[int, int, int]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, model_key: Hashable, tokens: Sequence[int]) -> None:
        if tokens:
            with self._lock:
                self._seen.append((len(tokens), tokens[-1], hash((model_key, tuple(tokens)))))

    def ends_in(self, model_key: Hashable, tokens: Sequence[int]) -> list[int]:
        """Ascending lengths of the recent prompts under ``model_key`` that ``tokens`` start
        with and go past."""
        key = tuple(tokens)
        with self._lock:
            seen = set(self._seen)
        return sorted(length for length, last, digest in seen
                      if length < len(key) and key[length - 1] == last
                      and hash((model_key, key[:length])) == digest)

    def prompt_len(self, model_key: Hashable, tokens: Sequence[int]) -> int | None:
        """How many of ``tokens`` were a recent request's prompt (the rest was generated)."""
        ends = self.ends_in(model_key, tokens)
        return ends[-1] if ends else None

    def boundaries(self, model_key: Hashable, tokens: Sequence[int]) -> tuple[int, ...]:
        """The latest :data:`MAX_PROMPT_BOUNDARIES` prompt ends inside ``tokens``."""
        return tuple(self.ends_in(model_key, tokens)[-MAX_PROMPT_BOUNDARIES:])
