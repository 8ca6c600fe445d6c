"""``python -u -m hetseq_hpc.launch.slurm_task FOLDER``: what every task of a het job's step
runs. It is submitit's job process (``python -m submitit.core._submit FOLDER``) that, once the
job's result is written, ends without the interpreter's teardown of torch's modules
(docs/design/rank-template.md, "The end of a process")."""

from __future__ import annotations

import argparse

from submitit.core.submission import process_job

from hetseq_hpc.env.process_end import end_process


def main() -> None:
    """Run the job pickled in ``FOLDER`` (``<job id>_submitted.pkl``) as submitit's own entry
    point does (:func:`submitit.core.submission.process_job`: its signal handlers, the result
    or the error pickled beside it), then end with exit status 0 as a normal exit would, less
    the teardown of the modules (:func:`~hetseq_hpc.env.process_end.end_process`: threads
    joined, ``atexit`` handlers run, streams flushed; ~1.7 CPU-s of every task that imported
    ``torch._dynamo``). A job that raised, or a ``SystemExit`` (a rank stopped after a
    checkpoint exits 3), leaves through the interpreter's own exit, as before, with the
    traceback and status it gives.

    Raises:
        Exception: whatever the job raised, after submitit pickled it as the task's error.
    """
    parser = argparse.ArgumentParser(description="Run one task of a hetseq_hpc Slurm job")
    parser.add_argument("folder", help="the job's submitit folder (cluster.folder)")
    process_job(parser.parse_args().folder)
    end_process(0)


if __name__ == "__main__":
    main()
