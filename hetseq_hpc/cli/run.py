"""``hetseq-hpc run`` and ``hetseq-hpc render``: continue a saved run, or start a new one
through the Hydra entry point, with the checks that must come before Hydra writes anything.

Before Hydra starts (it creates the run directory and writes ``.hydra/`` at once):

1. an internal schema (``task=bert_schema``) is refused as an option;
2. the overrides are composed and validated (:func:`hetseq_hpc.cli.hydra_entry.precheck_overrides`);
3. when ``hydra.run.dir`` holds an earlier run's ``hetseq_config.yaml`` and ``trainer.resume``
   is not ``never``, the run continues from that saved configuration with the command line's
   overrides on top (:mod:`hetseq_hpc.cli.resume`): checked against the checkpoint first,
   and started without Hydra, so the earlier run's ``.hydra/`` stays as it was;
4. the run directory's lock is taken (:mod:`hetseq_hpc.rundir.lock`): a directory in use is
   refused before anything is written, and a finished run says so in one line and starts
   nothing (:mod:`hetseq_hpc.train.finished`).
"""

from __future__ import annotations

from typing import List

from hetseq_hpc.cli.hydra_entry import run_with_hydra
from hetseq_hpc.cli.overrides import refuse_internal_options
from hetseq_hpc.cli.resume import resume_saved_run
from hetseq_hpc.errors import ConfigError


def run(argv: List[str]) -> int:
    """``hetseq-hpc run``: resume from a saved configuration, or hand ``argv`` to Hydra.

    Returns the exit code (Hydra's entry point exits by itself on errors).
    """
    refuse_internal_options(argv)
    if not any(a.startswith("-") for a in argv):
        resumed = resume_saved_run(argv)
        if resumed is not None:
            return resumed
    run_with_hydra(argv)
    return 0


def render(argv: List[str]) -> int:
    """``hetseq-hpc render``: ``run`` with ``cluster.dry_run=true`` on a SLURM cluster.

    Raises:
        ConfigError: the composed cluster is ``local`` (nothing to render).
    """
    from hetseq_hpc.config import compose_run_config

    refuse_internal_options(argv)
    overrides = [
        a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith("hydra.")
    ]
    if compose_run_config(overrides).cluster.is_local:
        raise ConfigError(
            "render writes a SLURM job script but cluster=local runs on this "
            "machine: pick a SLURM cluster, e.g. cluster=mixed"
        )
    return run([*argv, "cluster.dry_run=true"])
