"""Hand a validated run to its launcher (local ranks, or one SLURM het job), and say how it
ended: the summary of a local run or of a SLURM job waited for, or the one-line error with its exit code
(:data:`hetseq_hpc.errors.EXIT_CODES`)."""

from __future__ import annotations

import logging
import shutil
import sys
from typing import Any, Dict

from hetseq_hpc.config import RunConfig
from hetseq_hpc.errors import INTERRUPTED, HetseqError, report_error
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.rundir.storage import reported

log = logging.getLogger("hetseq_hpc")


def dispatch(run: RunConfig, run_dir: RunDir) -> Dict[str, Any]:
    """Start ``run`` with the launcher its cluster names; returns the launcher's result."""
    if run.cluster.is_local:
        from hetseq_hpc.launch.local import launch_local

        summary = launch_local(run, run_dir)
        _report(summary, run_dir)
        return summary
    from hetseq_hpc.launch.slurm import launch_slurm

    if getattr(run.cluster, "choose", "none") != "none":  # the mix that finishes first / cheapest
        from hetseq_hpc.launch.test_only import choose_mix

        run = choose_mix(run, run_dir)
    result = launch_slurm(run, run_dir)
    _report(result.get("summary") or {}, run_dir)  # a job waited for (cluster.wait=true)
    return result


def _rate(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) and value > 0 else "n/a"


def _report(summary: Dict[str, Any], run_dir: RunDir) -> None:
    if not summary:
        return
    val = summary.get("validation") or {}
    mfu = summary.get("mfu")
    log.info(
        "done: %s steps, loss %.4f -> %.4f, validation %s, %.1f samples/s (training steps; "
        "steady state %s, over the whole fit with validation and checkpoints %s%s)",
        summary.get("final_step"),
        summary.get("first_loss") or float("nan"),
        summary.get("final_loss") or float("nan"),
        ", ".join(f"{k[4:] if k.startswith('val_') else k} {v:.4g}" for k, v in val.items())
        or "n/a",
        summary.get("samples_per_s") or 0.0,
        _rate(summary.get("steady_samples_per_s")),
        _rate(summary.get("fit_samples_per_s")),
        f", MFU {100 * mfu:.1f} %" if mfu else "",
    )
    for rank in summary.get("ranks", []):
        thr = rank.get("samples_per_compute_s")
        log.info(
            "  rank %d %-28s %5d samples, %s samples/s",
            rank["rank"],
            rank["device"],
            rank["samples"],
            f"{thr:.1f}" if thr else "n/a",
        )
    log.info("metrics: %s  allocation: %s", run_dir.metrics, run_dir.allocation)
    if summary.get("plot"):
        log.info("plot: %s", summary["plot"])


def dispatch_or_exit(run: RunConfig, run_dir: RunDir, new_dir: bool = False) -> Any:
    """:func:`dispatch`, with every error as one line and its exit code
    (:func:`~hetseq_hpc.errors.report_error`). A SLURM run refused before anything was
    submitted (``sinfo`` checks, ``sbatch`` refusing, Slurm missing) removes the run directory
    when it was ``new_dir`` (created by Hydra for this attempt): a rejected attempt leaves
    nothing behind. A job that stopped after a checkpoint and will not go on by itself (its
    requeues used up) exits 3 with the command that continues it. A write of the launcher's
    own that finds the run directory full or read-only is one line too
    (:class:`~hetseq_hpc.errors.StorageError`)."""
    try:
        try:
            return dispatch(run, run_dir)
        except OSError as exc:  # the launcher's own writes (its config, job files)
            shown = reported(exc, run_dir)
            if shown is exc:
                raise
            raise shown from None
    except HetseqError as exc:
        if new_dir and not run.cluster.is_local and not run_dir.job.exists():
            shutil.rmtree(run_dir.root, ignore_errors=True)
        sys.exit(report_error(exc))
    except KeyboardInterrupt:
        print(
            f"hetseq-hpc: interrupted; the ranks checkpointed after their last step: continue "
            f"with hydra.run.dir={run_dir} trainer.resume=auto",
            file=sys.stderr,
        )
        sys.exit(INTERRUPTED)
