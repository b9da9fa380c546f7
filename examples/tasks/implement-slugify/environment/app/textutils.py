"""Text helpers."""

from __future__ import annotations


def title_case(text: str) -> str:
    """Each word's first letter in uppercase, the rest in lowercase."""
    return " ".join(word[:1].upper() + word[1:].lower() for word in text.split(" "))


def slugify(text: str, max_length: int = 50) -> str:
    """A URL slug of ``text``:

    - ASCII letters (lowercased) and ASCII digits are kept;
    - every run of other characters (spaces, punctuation, non-ASCII letters, ...) becomes a single ``-``;
    - there is no ``-`` at the start or the end;
    - the slug is cut to at most ``max_length`` characters, and a ``-`` the cut leaves at the end is removed.

    slugify("Hello, World!") == "hello-world"; slugify("  Ünïcode   rocks ") == "n-code-rocks".
    """
    raise NotImplementedError
