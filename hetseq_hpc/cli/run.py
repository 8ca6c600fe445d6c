"""``hetseq-hpc run`` and ``hetseq-hpc render``: continue a saved run, or start a new one
through Hydra, with the checks that must come before Hydra writes anything.

Before Hydra starts (it creates the run directory and writes ``.hydra/`` at once):

1. an internal schema (``task=bert_schema``) is refused as an option;
2. the command line is read once (:class:`~hetseq_hpc.cli.overrides.CommandLine`) and its run
   loaded (:func:`hetseq_hpc.cli.load.load_run`): composed once and validated. When
   ``hydra.run.dir`` holds an earlier run's ``hetseq_config.yaml`` and ``trainer.resume`` is
   not ``never``, the run continues from that saved configuration with the command line's
   overrides on top, and starts without Hydra, so the earlier run's ``.hydra/`` stays as it
   was;
3. the run directory's lock is taken (:mod:`hetseq_hpc.rundir.lock`): a directory in use is
   refused before anything is written, and a finished run says so in one line and starts
   nothing (:mod:`hetseq_hpc.cli.start`).

Hydra's flags (``-m`` sweeps, ``--cfg job``, ...) go to :mod:`hetseq_hpc.cli.hydra_entry`.
"""

from __future__ import annotations

from typing import List

from hetseq_hpc.cli.hydra_entry import run_hydra_flags
from hetseq_hpc.cli.load import load_run
from hetseq_hpc.cli.overrides import CommandLine, refuse_internal_options
from hetseq_hpc.cli.start import start_run
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.config.compose import run_overrides
from hetseq_hpc.errors import ConfigError


def run(argv: List[str]) -> int:
    """``hetseq-hpc run``: load the command line's run once and start it (or hand Hydra's
    flags to Hydra).

    Returns the exit code.

    Raises:
        HetseqError: a bad value, a run directory that cannot be used, a checkpoint that does
            not fit (one line each; nothing is written).
    """
    refuse_internal_options(argv)
    cmd = CommandLine.parse(argv)
    if cmd.flags or cmd.sweep:
        return run_hydra_flags(cmd)
    return start_run(load_run(cmd))


#: what ``render`` adds to the command line
DRY_RUN = "cluster.dry_run=true"


def render(argv: List[str]) -> int:
    """``hetseq-hpc render``: ``run`` with ``cluster.dry_run=true`` on a SLURM cluster.

    Raises:
        ConfigError: the composed cluster is ``local`` (nothing to render).
    """
    refuse_internal_options(argv)
    try:
        return run([*argv, DRY_RUN])
    except ConfigError:
        # cluster=local has no cluster.dry_run: say why there is nothing to render
        if compose_run_config(run_overrides(argv)).cluster.is_local:
            raise ConfigError(
                "render writes a SLURM job script but cluster=local runs on this "
                "machine: pick a SLURM cluster, e.g. cluster=mixed"
            ) from None
        raise
