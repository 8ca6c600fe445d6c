"""A text corpus on disk: CPython's help topics (pydoc_data), written as a file."""

from __future__ import annotations

from pathlib import Path


def pydoc_text(copies: int = 1) -> str:
    from pydoc_data import topics

    text = "\n\n".join(t for _, t in sorted(topics.topics.items()))
    return "\n\n".join(text for _ in range(copies))


def write_corpus(tmp_path: Path, text: str, name: str = "corpus.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path
