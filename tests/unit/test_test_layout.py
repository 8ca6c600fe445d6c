"""The test tree itself: every test module's file name is unique across the tiers (the tier
folders are not packages, so two ``test_x.py`` stop a run of every tier at collection with
"import file mismatch", which a run of one tier does not show)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_every_test_module_name_is_unique_across_the_tiers():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    twice = sorted(name for name, count in names.items() if count > 1)
    assert not twice, f"test modules with the same name in two folders: {twice}: rename one"
