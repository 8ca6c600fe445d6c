"""``hetseq-hpc plan --when`` (or ``plan.when=true``): time to result of every candidate mix of
the configured partitions, from Slurm's start estimates (``sbatch --test-only``, nothing is
submitted) plus the planner's predicted run time, sorted by expected finish.

The table (:mod:`hetseq_hpc.plan.when_table`) is followed by one JSON line with the same
figures. Errors are one ``hetseq-hpc plan: error: ...`` line (exit code 2 for a bad value,
1 when Slurm cannot be asked).
"""

from __future__ import annotations

import sys
from typing import Sequence

from hetseq_hpc.errors import HetseqError, report_error

PROG = "hetseq-hpc plan"


def wants_when(argv: Sequence[str]) -> bool:
    """Whether a planner command line sets ``plan.when`` true (composed, so every spelling
    Hydra reads as true counts); False without a ``plan.when`` override.

    Raises:
        ConfigError: the overrides do not compose (one line).
    """
    if not any(a.lstrip("+~").partition("=")[0] == "plan.when" for a in argv):
        return False
    from hetseq_hpc.plan.command import compose_plan_run

    return bool(compose_plan_run(list(argv)).plan.when)


def when_command(argv: Sequence[str]) -> int:
    """Compose the planner command line ``argv``, rank the mixes
    (:func:`hetseq_hpc.launch.test_only.plan_when`) and print the table and its JSON line.

    Returns:
        0, or the exit code of the one-line error printed on stderr.
    """
    from hetseq_hpc.launch.test_only import plan_when
    from hetseq_hpc.plan.command import compose_plan_run
    from hetseq_hpc.plan.when_table import render_when, when_json

    try:
        run = compose_plan_run(list(argv))
        table, _ = plan_when(run)
    except HetseqError as exc:
        return report_error(exc, PROG)
    print(render_when(table, run))
    print(when_json(table, run))
    sys.stdout.flush()
    return 0
