"""scripts/check_docstrings.py: module docstrings of at most 20 lines (run by
scripts/run-tests.sh beside the lint step)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "check_docstrings.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_docstrings", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module(lines: int) -> str:
    """A module whose docstring takes ``lines`` lines, quotes included."""
    body = "\n".join(f"line {i}" for i in range(lines - 1))
    return f'"""{body}\n"""\n\nX = 1\n'


def test_the_repository_has_no_long_module_docstring(checker, capsys):
    assert checker.main([]) == 0
    assert capsys.readouterr().out == ""


def test_a_21_line_docstring_is_named_and_fails(checker, tmp_path, capsys):
    (tmp_path / "long.py").write_text(_module(21))
    (tmp_path / "ok.py").write_text(_module(20))
    (tmp_path / "none.py").write_text("X = 1\n")
    assert checker.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1
    assert out[0].endswith("long.py:1: module docstring is 21 lines (at most 20)")


def test_the_span_counts_the_lines_the_docstring_takes(checker):
    assert checker.docstring_span(_module(20)) == (1, 20)
    assert checker.docstring_span('"""One line."""\n') == (1, 1)
    assert checker.docstring_span("#!/usr/bin/env python3\n" + _module(3)) == (2, 3)
    assert checker.docstring_span("import os\n") is None
    assert checker.docstring_span("") is None
