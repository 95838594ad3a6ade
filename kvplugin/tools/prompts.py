"""Prompt text of a given token length for the tiny model (demo and server benchmark)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

__all__ = ["QUESTIONS", "TextMaker"]

# The user turns of the demo's conversation (and of the server benchmark's).
QUESTIONS = [
    "Tell me about the bridge and the two rivers.",
    "When does the bakery open, and what does the street smell like?",
    "Which buses leave from the square in the morning?",
    "What happens on market days?",
    "Who repaired the bridge after the flood?",
    "Why must the boats wait for low water?",
    "Describe the morning mist over the water.",
    "How many arches does the old bridge have?",
]


class TextMaker:
    """Readable text of (about) a given number of the tiny model's tokens.

    Sentences of the local corpus, shuffled by ``seed`` and prefixed with a tag, so that two
    seeds give prompts that differ from their first words (no accidental shared prefix).
    Token counts come from the model's own ``tokenizer.json`` (exact to a few tokens; the
    server's ``usage.prompt_tokens`` is what gets reported).
    """

    def __init__(self, model_dir: Path | str):
        from kvplugin.tools.models.corpus import CORPUS

        self._sentences = [s.strip() + "." for s in re.split(r"\.\s+", " ".join(CORPUS.split()))
                           if len(s.strip()) > 2]
        self._tok = None
        try:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        except Exception:  # no tokenizers: ~3.2 characters per token on this corpus
            self._tok = None

    def starts(self) -> list[str]:
        """Words that each begin a text with a different first token (as many as the
        vocabulary allows): prompts starting with different ones share no prefix at all."""
        if self._tok is None:
            words = sorted({w for s in self._sentences for w in re.findall(r"[A-Za-z]{3,}", s)})
            return words
        out, seen = [], set()
        for i in range(self._tok.get_vocab_size()):
            word = self._tok.decode([i])
            if len(word.strip()) < 2 or not word.strip().isalpha() or i in seen:
                continue
            if self._tok.encode(word + " 1.").ids[0] == i:
                seen.add(i)
                out.append(word)
        return out

    def first_token(self, text: str) -> int | str:
        if self._tok is None:
            return text.split(None, 1)[0] if text.strip() else ""
        ids = self._tok.encode(text).ids
        return ids[0] if ids else -1

    def count(self, text: str) -> int:
        if self._tok is None:
            return max(1, round(len(text) / 3.2))
        return len(self._tok.encode(text).ids)

    def text(self, n_tokens: int, seed: Any, tag: str | None = None) -> str:
        rng = random.Random(str(seed))
        order = list(self._sentences)
        rng.shuffle(order)
        head = f"{tag or 'Notes'} {rng.randrange(10**6):06d}."
        parts, i = [head], 0
        while self.count(" ".join(parts)) < n_tokens:
            parts.append(order[i % len(order)])
            i += 1
            if i % len(order) == 0:
                rng.shuffle(order)
        text = " ".join(parts)
        if self._tok is not None:
            ids = self._tok.encode(text).ids
            if len(ids) > n_tokens:
                text = self._tok.decode(ids[:n_tokens])
        return text
