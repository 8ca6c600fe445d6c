#!/usr/bin/env python3
"""Fail when a module docstring is longer than 20 lines (CONTRIBUTING.md, "Checks").

A module docstring says what the module owns and points to its design note in
``docs/design/``; the essay lives there. The length counted is the lines the docstring takes
in the file, from its opening to its closing quotes.

    python scripts/check_docstrings.py [PATH ...]   # default: hetseq_hpc tests scripts examples

Prints ``path:line: module docstring is N lines (at most 20)`` for each offender and exits 1
if there is any, else exits 0 silently.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

MAX_LINES = 20
DEFAULT_PATHS = ("hetseq_hpc", "tests", "scripts", "examples")
ROOT = Path(__file__).resolve().parent.parent


def python_files(paths: List[str]) -> Iterator[Path]:
    """Every ``*.py`` file under ``paths`` (files or folders, relative to the repository root),
    sorted, skipping virtual environments and build folders."""
    skip = {".venv", "build", "__pycache__"}
    for name in paths:
        path = Path(name) if Path(name).is_absolute() else ROOT / name
        if path.is_file():
            yield path
            continue
        for file in sorted(path.rglob("*.py")):
            if not skip.intersection(file.relative_to(path).parts):
                yield file


def docstring_span(source: str) -> Optional[Tuple[int, int]]:
    """``(first line, number of lines)`` of the module docstring of ``source``, or None when
    it has none. Raises SyntaxError for a file that does not parse."""
    body = ast.parse(source).body
    if not body:
        return None
    first = body[0]
    if not (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return None
    return first.lineno, (first.end_lineno or first.lineno) - first.lineno + 1


def main(argv: List[str]) -> int:
    offenders = 0
    for file in python_files(argv or list(DEFAULT_PATHS)):
        span = docstring_span(file.read_text(encoding="utf-8"))
        if span and span[1] > MAX_LINES:
            offenders += 1
            shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
            print(f"{shown}:{span[0]}: module docstring is {span[1]} lines (at most {MAX_LINES})")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
