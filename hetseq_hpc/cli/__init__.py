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
    ``sys.argv`` (:func:`hetseq_hpc.cli.parser.dispatch_command`) and exit with its code. A
    command that imported torch (an elastic run's store, ``task=hf``'s checks, ``export``,
    ``plan``) ends without the interpreter's teardown of torch's modules
    (:func:`hetseq_hpc.env.process_end.end_process`: threads joined, ``atexit`` handlers run,
    ~1.7 CPU-s less); any other exits as usual."""
    from hetseq_hpc.cli.parser import dispatch_command

    code = dispatch_command(sys.argv[1:])
    if "torch" in sys.modules:
        from hetseq_hpc.env.process_end import end_process

        end_process(code)
    sys.exit(code)


__all__ = ["main"]
