"""Real English text shipped with kvplugin, for prompts on a real pretrained model.

WHY a shipped file: tests and benchmarks on a real model need long prompts of natural
text that are identical on every machine and Python version, offline. Docstrings of the
standard library change between Python releases; a public-domain document does not.

Texts (plain UTF-8 files in ``texts/``, public domain):

- ``declaration-of-independence``: the United States Declaration of Independence (1776),
  about 1,330 words (about 1.7k SmolLM2 tokens).
- ``gnu-gpl-3``: the GNU General Public License, version 3 (2007), about 5,600 words, whose
  own terms let everyone copy it verbatim; long enough for several disjoint windows of
  1k tokens and more (``kvplugin bench --quality --real-model``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["names", "text", "paragraphs"]

_DIR = Path(__file__).resolve().parent / "texts"


def names() -> list[str]:
    """The shipped texts' names, sorted."""
    return sorted(p.stem for p in _DIR.glob("*.txt"))


def text(name: str = "declaration-of-independence") -> str:
    """The whole text ``name``, exactly as shipped."""
    path = _DIR / f"{name}.txt"
    if not path.is_file():
        raise KeyError(f"no shipped text {name!r}; have {names()}")
    return path.read_text(encoding="utf-8")


def paragraphs(name: str = "declaration-of-independence") -> list[str]:
    """The non-empty paragraphs of ``name`` (split on blank lines), stripped."""
    return [p.strip() for p in text(name).split("\n\n") if p.strip()]
