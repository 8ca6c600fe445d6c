"""Plan a heterogeneous run before submitting it: predicted split, step time and efficiency.

Usage::

    python -m hetseq_hpc.plan cluster=mixed task=bert trainer.global_batch_size=4096 [plan.KEY=VALUE ...]

The configuration is composed and validated as ``python -m hetseq_hpc`` does it, but nothing
is launched; the plan is printed per partition and rank class, then ONE final JSON line.
Options are the ``plan`` config group (:mod:`hetseq_hpc.config.plan`); ``plan.when=true``
ranks partition mixes by time to result. Every option and the JSON keys:
docs/design/planner.md, "`hetseq-hpc plan` and its options". Errors are one line, exit code 2.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

from hetseq_hpc.config.compose import group_choices, is_hydra_override
from hetseq_hpc.config.plan import plan_keys
from hetseq_hpc.errors import ConfigError, report_error
from hetseq_hpc.plan.planner import make_plan
from hetseq_hpc.plan.render import headline_json, render

PROG = "hetseq-hpc plan"


def plan_overrides(argv: Sequence[str]) -> List[str]:
    """The Hydra overrides of a planner command line: ``hydra.*`` dropped (nothing is launched,
    so there is no run directory), ``plan.*`` keys checked against :class:`PlanConfig`.

    Raises:
        ConfigError: an option (``-x``), or an unknown ``plan.*`` key.
    """
    overrides: List[str] = []
    for arg in argv:
        if arg.startswith("-"):
            raise ConfigError(
                f"{arg!r} is not an option: pass Hydra overrides (key=value) and "
                "plan.KEY=VALUE options; see --help"
            )
        if is_hydra_override(arg):
            continue
        key = arg.lstrip("+~").partition("=")[0]
        if key.startswith("plan.") and key[len("plan.") :] not in plan_keys():
            known = ", ".join(f"plan.{k}" for k in plan_keys())
            raise ConfigError(f"{key} is not a planner option: use one of {known}")
        overrides.append(arg)
    return overrides


def compose_plan_run(argv: Sequence[str]):
    """The validated :class:`~hetseq_hpc.config.RunConfig` of a planner command line; its
    ``plan`` field holds the planner options.

    Raises:
        ConfigError: a bad override or value (one line).
    """
    from hetseq_hpc.config.compose import compose_run_config

    return compose_run_config(plan_overrides(argv))


def plan_command(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hetseq_hpc.plan [overrides] [plan.*=...]``: prints the plan; returns 0, or 2
    after one ``hetseq-hpc plan: error: ...`` line on stderr for a bad value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        run = compose_plan_run(argv)
        if run.plan.when:  # the planner never imports a launcher: sbatch --test-only is the CLI's
            raise ConfigError(
                "plan.when=true asks Slurm for start estimates, which this module "
                "does not: run hetseq-hpc plan --when (python -m hetseq_hpc plan "
                "--when)"
            )
        plan = make_plan(run, label=group_choices(plan_overrides(argv)).get("cluster"))
    except ConfigError as exc:
        return report_error(exc, PROG)
    for warning in plan.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    print(render(plan))
    print(headline_json(plan))
    return 0
