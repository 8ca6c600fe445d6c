"""Optional packages of the extras: skipped with a reason outside CI, required in CI.

CI installs the ``test`` extra (which holds every optional package a test needs), so a missing
package there is a broken install, not a reason to skip; on a developer's core install the
tests of an extra skip and say which extra brings the package.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def import_or_skip(name: str, extra: str) -> ModuleType:
    """``import name``; outside CI (``CI`` is not ``true``) a missing package skips the calling
    module's tests, naming ``pip install 'hetseq_hpc[<extra>]'``."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(name)
    return pytest.importorskip(
        name, reason=f"{name} is not installed: pip install 'hetseq_hpc[{extra}]' (CI has it)"
    )
