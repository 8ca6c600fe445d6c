"""The file names of a run directory are spelled only in :class:`hetseq_hpc.rundir.paths.RunDir`:
every other module asks a ``RunDir`` for the path, so a name changes in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import hetseq_hpc
from hetseq_hpc.rundir.paths import RunDir

PACKAGE = Path(hetseq_hpc.__file__).parent

#: the names RunDir owns (files and folders of a run directory), but ``wandb``: W&B's folder
#: has the name of the logger and of its package, spelled as such in the configuration
NAMES = sorted(
    {
        value
        for key, value in vars(RunDir).items()
        if key.endswith("_NAME") or key == "RUN_FILE"
        if isinstance(value, str) and value != RunDir.WANDB_NAME
    }
    | {RunDir.STOP_RECORD.name, RunDir("").hydra_overrides.name}
)
#: names built from a rank or a token: ``rank<N>.log``, ``rank<N>.error.json``, the markers
PATTERNS = [
    re.compile(r"(^|/)rank(\d+|\*)?\.(log|error\.json|emulation\.json)$"),
    re.compile(r"^\.(error|emulation)\.json$"),
    re.compile(r"(^|/)\.prepar(ed|ing)-"),
]
#: (module relative to hetseq_hpc/, the constant) spelled there on purpose, and why
ALLOWED = {
    # ``sbatch --test-only``'s script and submitit folder in a temporary folder, not a run's
    ("launch/test_only.py", RunDir.SBATCH_NAME),
    ("launch/test_only.py", RunDir.SUBMITIT_NAME),
    # transformers' weights file of a model directory (task=hf), not a run directory's
    ("tasks/hf/model_files.py", RunDir.EXPORT_FILE_NAME),
}


def spelled(value: str) -> bool:
    """Whether the string constant ``value`` spells a run directory's file name as a path (the
    name alone, or a path ending or starting with it); prose naming a file (a message, a help
    text: the constant holds a space) is not."""
    if any(c.isspace() for c in value):
        return False
    for name in NAMES:
        if value == name or value.endswith("/" + name) or value.startswith(name + "/"):
            return True
    return any(p.search(value) for p in PATTERNS)


def docstrings(tree: ast.AST) -> Set[int]:
    """``id()`` of every docstring constant in ``tree``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def spellings(path: Path) -> Iterator[Tuple[int, str]]:
    """``(line, constant)`` of each run directory name spelled in ``path``'s code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = docstrings(tree)
    for node in ast.walk(tree):
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and id(node) not in skip and spelled(text):
            yield node.lineno, text


def outside_rundir() -> List[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith("rundir/"):
            continue
        for line, value in spellings(path):
            if (module, value) not in ALLOWED:
                found.append(f"hetseq_hpc/{module}:{line}: {value!r}")
    return found


def test_run_directory_names_are_spelled_only_in_rundir():
    found = outside_rundir()
    assert not found, "ask RunDir (hetseq_hpc/rundir/paths.py) for these paths:\n" + "\n".join(
        found
    )


def test_the_check_sees_a_name_spelled_as_a_path(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""A docstring may name summary.json and logs/rank0.log."""\n'
        "def f(run_dir, rank, token):\n"
        '    """So may ``job.json``."""\n'
        '    print("see the summary.json of the run")  # prose: allowed\n'
        '    a = run_dir / "job.json"\n'
        '    b = f"{run_dir}/summary.json"\n'
        '    c = run_dir / "logs" / f"rank{rank}.error.json"\n'
        '    d = run_dir / "logs" / f".prepared-{token}.json"\n'
    )
    assert [line for line, _ in spellings(module)] == [5, 6, 7, 7, 8, 8]
