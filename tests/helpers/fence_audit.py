"""File by file: did a rank that the others left out write into the run directory after?

Used by tests/integration/test_elastic.py and scripts/partition_drills.py. A left-out rank is
stopped (SIGSTOP standing in for a partition) from before the re-form until it "comes back"
at ``since_ns``; anything of its own written at or after that was written after the re-form:
its files (``logs/rank<N>.*``) by their modification time, and the rows, checkpoints and
JSON records that carry ``written_by`` (hetseq_hpc/files/fence.py) by their stamp.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.files import stored_state


def _by(record: Any, member: int) -> bool:
    """Whether ``record`` (a row, a checkpoint, a JSON object) says ``member`` wrote it."""
    stamp = record.get("written_by") if isinstance(record, dict) else None
    return isinstance(stamp, dict) and stamp.get("rank") == member


def _rows(path: Path) -> List[Dict[str, Any]]:
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _lost_at(rows: List[Dict[str, Any]], member: int) -> Optional[int]:
    """The index of the first membership row that lost ``member``, or None."""
    for i, row in enumerate(rows):
        if row.get("event") == "membership" and member in [x.get("rank") for x in row["lost"]]:
            return i
    return None


def writes_after_fence(run_dir: Path, member: int, since_ns: int) -> List[str]:
    """One line per file or row of ``run_dir`` that ``member`` wrote at or after ``since_ns``
    (``time.time_ns()`` when it came back, after the others re-formed without it); ``[]``
    when it wrote nothing."""
    found = []
    run = RunDir(run_dir)
    for path in sorted(Path(run_dir).rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        rel = path.relative_to(run_dir)
        new = path.stat().st_mtime_ns >= since_ns
        if path.name.startswith(f"rank{member}.") and new:
            found.append(f"{rel}: modified after rank {member} came back")
        elif path.name.startswith(f".rank{member}.") and path.name.endswith(".tmp"):
            found.append(f"{rel}: a temporary file of rank {member}")
        elif path == run.metrics:
            rows = _rows(path)
            lost = _lost_at(rows, member)
            found += [
                f"{rel}: row {i + 1} (step {row.get('step')}) by rank {member} after it was lost"
                for i, row in enumerate(rows)
                if lost is not None and i > lost and _by(row, member)
            ]
        elif path == run.events:
            found += [
                f"{rel}: {row.get('event')} row by rank {member} after it came back"
                for row in _rows(path)
                if _by(row, member) and float(row.get("time", 0)) * 1e9 >= since_ns
            ]
        elif new and path.suffix == ".pt" and _by(stored_state(path), member):
            found.append(f"{rel}: checkpoint written by rank {member} after it came back")
        elif new and path.suffix == ".json":
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                continue
            if _by(record, member):
                found.append(f"{rel}: written by rank {member} after it came back")
    return found


__all__ = ["writes_after_fence"]
