"""The ``hetseq-hpc`` command line (also ``python -m hetseq_hpc``).

Imports go one way, top to bottom::

    parser       argparse: one subcommand per job (run, plan, probe, render, report, prepare)
      run          run / render: continue a saved run (resume) or start a new one (hydra_entry)
        resume       continue a run directory from its saved hetseq_config.yaml, without Hydra
        hydra_entry  the one Hydra entry point of a new run (pre-check, then @hydra.main)
          dispatch     hand the validated run to a launcher (hetseq_hpc.launch); report the end
          preflight    checks before anything starts (the checkpoint a run would resume from)
          overrides    reading the command line's overrides (keys, values, the run directory)
      probe, prepare   the probe and prepare subcommands

Errors are one line; their exit codes come from one table, :data:`hetseq_hpc.errors.EXIT_CODES`.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Console entry point (``hetseq-hpc``, ``python -m hetseq_hpc``): run the subcommand of
    ``sys.argv`` (:func:`hetseq_hpc.cli.parser.dispatch_command`) and exit with its code."""
    from hetseq_hpc.cli.parser import dispatch_command

    sys.exit(dispatch_command(sys.argv[1:]))


__all__ = ["main"]
