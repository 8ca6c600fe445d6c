#!/usr/bin/env python3
"""Where a test suite's CPU went, by kind of process and by test, from the lines that
``scripts/suite_cpu/sitecustomize.py`` recorded.

    PYTHONPATH=scripts/suite_cpu HETSEQ_PROC_LOG=/tmp/procs.log CI=true bash .ci/run
    python scripts/suite_cpu/report.py /tmp/procs.log [--tests 25]

Prints the kinds (forked ranks, launchers with and without torch, CLI subcommands, Slurm
tasks, store servers, pytest workers, pip, ...) with their process count, CPU minutes and
mean CPU seconds, then the tests whose processes took the most CPU (the pytest workers' own
work is not split by test). Processes that ended by ``os._exit`` or a signal are not in it.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Process:
    """One recorded process: CPU and wall seconds, name, torch imported, test, first words."""

    cpu_s: float
    wall_s: float
    comm: str
    torch: bool
    test: str
    words: str


def read(path: Path) -> List[Process]:
    """The processes of a ``HETSEQ_PROC_LOG`` file (malformed lines skipped)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) < 8:
            continue
        try:
            cpu, wall = float(fields[0]), float(fields[1])
        except ValueError:
            continue
        rows.append(Process(cpu, wall, fields[2], fields[5] == "torch", fields[6], fields[7]))
    return rows


def kind(proc: Process) -> str:
    """What the process was, from its name and first words."""
    words = proc.words.split()
    first = words[0] if words else ""
    torch = " (imports torch)" if proc.torch else ""
    if proc.comm.startswith("hetseq-rank"):
        return "rank forked from a template"
    if proc.comm == "hetseq-template":
        return "rank template"
    if first == "-c" and not proc.test:
        return "pytest-xdist worker (its own tests, collection)"
    if "hetseq_hpc.worker" in proc.words[:40]:
        return "rank, own interpreter"
    if first.endswith(("submitit/core/_submit.py", "hetseq_hpc/launch/slurm_task.py")):
        return "Slurm task (submitit)"
    if first.endswith("store_server.py"):
        return "job store server"
    if first.endswith("hetseq_hpc/__main__.py"):
        rest = words[1] if len(words) > 1 else ""
        command = rest if rest and "=" not in rest and not rest.startswith("-") else "run"
        return f"CLI {command}{torch}"
    if "pip" in proc.words:
        return "pip"
    if first.endswith("pytest") or (first.endswith("__main__.py") and "tests/" in proc.words):
        return "pytest"
    return f"{Path(first).name or '?'}{torch}"


def tables(rows: List[Process], top: int) -> Tuple[List[str], List[str]]:
    """The two tables as lines: by kind, and the ``top`` tests by their processes' CPU."""
    by_kind: Dict[str, List[float]] = collections.defaultdict(list)
    by_test: Dict[str, float] = collections.Counter()
    for proc in rows:
        by_kind[kind(proc)].append(proc.cpu_s)
        if proc.test:
            by_test[proc.test] += proc.cpu_s
    kinds = [
        f"{sum(c) / 60:7.2f} CPU-min  {len(c):5d} processes  {sum(c) / len(c):6.2f} s each  {k}"
        for k, c in sorted(by_kind.items(), key=lambda item: -sum(item[1]))
    ]
    tests = [
        f"{cpu:8.1f} CPU-s  {test}"
        for test, cpu in sorted(by_test.items(), key=lambda item: -item[1])[:top]
    ]
    return kinds, tests


def main() -> None:
    """Print the report of the file named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path, help="the HETSEQ_PROC_LOG file")
    parser.add_argument("--tests", type=int, default=25, help="how many tests to list")
    args = parser.parse_args()
    rows = read(args.log)
    kinds, tests = tables(rows, args.tests)
    print(f"{len(rows)} processes, {sum(p.cpu_s for p in rows) / 60:.1f} CPU-min in all")
    print("\n".join(kinds))
    print(f"\nthe {args.tests} tests whose processes took the most CPU:")
    print("\n".join(tests))


if __name__ == "__main__":
    main()
