"""The ``hetseq-hpc`` command line (also ``python -m hetseq_hpc``).

Imports go one way, top to bottom::

    parser       argparse: one subcommand per job (run, plan, probe, render, report, prepare)
      run          run / render: read the command line once, load its run, start it
        start        start a loaded run: a resumed one without Hydra, a new one through Hydra
          hydra_entry  Hydra's part: a new run's directory and .hydra/, sweeps (-m), Hydra's flags
            dispatch     hand the validated run to a launcher (hetseq_hpc.launch); report the end
        load         load_run: the validated run and its run directory, new or resumed, composed once
          resume       a saved hetseq_config.yaml with the command line's overrides on top
          preflight    checks before anything starts (the checkpoint a run would resume from)
          overrides    the command line read once (flags, overrides, Hydra's own, the run directory)
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
