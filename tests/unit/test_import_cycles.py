"""No import cycle hides inside a function (issue 42): the ``acyclic_siblings`` contract of
``pyproject.toml`` covers every package of hetseq_hpc, and import-linter's graph (grimp) counts
an import written inside a function like one at the top of the module. Checked here on a
throwaway package, in-process; ``lint-imports`` checks hetseq_hpc itself."""

from __future__ import annotations

import sys

from importlinter import configuration
from importlinter.application.use_cases import lint_imports

from tests.helpers.runs import REPO

CONTRACT = """\
[importlinter]
root_package = cyclepkg

[importlinter:contract:siblings]
name = no cycles
type = acyclic_siblings
ancestors = cyclepkg
"""


def _package(root, lazy_back: bool) -> None:
    """``cyclepkg.files`` imports ``cyclepkg.shards`` at the top; with ``lazy_back``,
    ``cyclepkg.shards`` imports ``cyclepkg.files`` back inside a function (the circle
    train/checkpoint_files.py and shard_files.py had)."""
    pkg = root / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "files.py").write_text("from cyclepkg.shards import verify\n")
    back = "    from cyclepkg.files import FIX\n" if lazy_back else ""
    (pkg / "shards.py").write_text(f"def verify():\n{back}    return 1\n")
    (root / "contracts.ini").write_text(CONTRACT)


def _lint(root, monkeypatch) -> bool:
    configuration.configure()  # what the lint-imports command does first
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] == "cyclepkg"]:
        monkeypatch.delitem(sys.modules, name)
    return lint_imports(config_filename=str(root / "contracts.ini"), cache_dir=None)


def test_a_cycle_through_an_import_inside_a_function_breaks_the_contract(tmp_path, monkeypatch):
    _package(tmp_path, lazy_back=True)
    assert not _lint(tmp_path, monkeypatch)


def test_the_same_package_without_the_import_back_keeps_it(tmp_path, monkeypatch):
    _package(tmp_path, lazy_back=False)
    assert _lint(tmp_path, monkeypatch)


def test_the_contract_covers_every_package_of_hetseq_hpc():
    text = (REPO / "pyproject.toml").read_text()
    contract = text[text.index('type = "acyclic_siblings"') :].split("[[", 1)[0]
    assert 'ancestors = ["hetseq_hpc"]' in contract
