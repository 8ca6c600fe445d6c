"""Plan a heterogeneous run before submitting it: predicted split, step time and efficiency.

Usage::

    python -m hetseq_hpc.plan cluster=mixed task=bert trainer.global_batch_size=4096 [plan.KEY=VALUE ...]
    python -m hetseq_hpc.plan cluster=local cluster.ranks=3 cluster.speeds=[1,0.5,0.25]

The run configuration is composed and validated exactly as ``python -m hetseq_hpc`` does it
(same ``conf/``, same overrides; ``hydra.*`` overrides are ignored), but nothing is launched: no
process group, no job, no data preparation. The planner prints, per partition and per rank
class (ranks with the same hardware and the same share), the samples per step, micro-batch x
accumulation steps and the predicted compute time, for the throughput-balanced split the runtime
will compute and for an equal split; then a summary; then ONE final JSON line with the headline
figures (``predicted_samples_per_s``, ``equal_split_samples_per_s``, ``ideal_samples_per_s``,
``efficiency``, ``speedup_vs_equal``, ``allreduce_share``, ``world_size``, ...). Warnings (a
global batch too small for the mix, a probe of another model) go to stderr, one line each.

Planner options: the ``plan`` config group (schema: ``hetseq_hpc/config/plan.py``)::

    plan.probe=PATH       allocation.json of an earlier run (or its run directory): use its
                          measured per-rank ``calibration`` (samples/s, memory) instead of the
                          GPU spec model. SLURM clusters match ranks to partitions by
                          ``partition`` name, then by ``gres`` = ``gpu_type``; cluster=local
                          matches by rank index.
    plan.link_gbps=100    network bandwidth per rank in Gbit/s for the all-reduce
                          (default 100 = InfiniBand EDR; 20 = loopback on cluster=local).
    plan.latency_us=10    per-message latency of one ring step, microseconds.
    plan.mfu=0.35         model FLOPs utilisation assumed against the datasheet peak, (0, 1].
    plan.overlap=ddp      how much all-reduce hides behind the backward pass: ``ddp`` (default)
                          models DDP's 25 MiB buckets overlapping the last micro-batch's
                          backward (Li et al., VLDB 2020); a number in [0, 1] fixes the hidden
                          share (0 = nothing overlaps, a lower bound, also printed).
    plan.peak=runtime     ``runtime``: the precision the runtime picks (precision.default=auto
                          -> bf16 tensor cores on compute capability >= 8.0, fp32 elsewhere);
                          ``tensor``: every GPU at its tensor-core peak (fp16 on V100/T4).

Time to result (``hetseq-hpc plan --when`` = ``plan.when=true``; SLURM clusters)::

    plan.when=false       true: rank the mixes of the partitions (each in or out, 1 .. its
                          nodes) by expected finish = Slurm's start estimate (sbatch
                          --test-only, nothing submitted) + startup + steps x step + checkpoints
    plan.startup_s=90     seconds from a job's start to its first step
    plan.checkpoint_gb_s=1  checkpoint write bandwidth, GB/s
    plan.max_mixes=32     most mixes asked about (node counts thinned above it, said so)
    cluster.choose=finish_first|cheapest  (hetseq-hpc run) submits the first / fewest GPU-h row

Cost model: :mod:`hetseq_hpc.plan.step_time`; GPU table: :mod:`hetseq_hpc.plan.gpus`.
Errors are one line naming the value and the fix, exit code 2.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

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
        key = arg.lstrip("+~").partition("=")[0]
        if key.startswith("hydra."):
            continue
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
        plan = make_plan(run)
    except ConfigError as exc:
        return report_error(exc, PROG)
    for warning in plan.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    print(render(plan))
    print(headline_json(plan))
    return 0
