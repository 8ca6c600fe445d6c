"""Every file of a run directory, named in one place (submitit's ``JobPaths`` is the model).

A run directory (``hydra.run.dir``, default ``outputs/<date>/<time>/``) holds::

    hetseq_config.yaml      the resolved configuration the workers ran (resume reads it)
    run.json                the current run's id (train/checkpoints and metrics rows carry it)
    metrics.jsonl           one JSON object per logged step (rank 0)
    events.jsonl            resumes, stops, checkpoints, start-overs (rundir/events.py)
    allocation.json         the agreed split and every rank's start-up report
    summary.json            final figures
    ranks.png               the per-rank picture
    checkpoints/            step_XXXXXXXX.pt + .sha256 (+ step_XXXXXXXX.<token>.shards/ of FSDP runs);
                            corrupt/ for files that failed it
    previous/<run id>/      an earlier run's records, moved there when a new run started
    logs/rank<N>.log        each rank's log; rank<N>.error.json a failed rank's one line
    cli.log                 the launcher's log
    .hetseq.lock            one run at a time (flock)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory; nothing is created by building it.

    Args:
        root: the run directory (``hydra.run.dir``).
    """

    root: Path

    CONFIG_NAME = "hetseq_config.yaml"
    METRICS_NAME = "metrics.jsonl"
    EVENTS_NAME = "events.jsonl"
    LOCK_NAME = ".hetseq.lock"
    RUN_FILE = "run.json"

    def __init__(self, root: Union[str, Path]):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        """``hetseq_config.yaml``: the configuration the workers run."""
        return self.root / self.CONFIG_NAME

    @property
    def run_file(self) -> Path:
        """``run.json``: the current run's id."""
        return self.root / self.RUN_FILE

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``."""
        return self.root / self.METRICS_NAME

    @property
    def events(self) -> Path:
        """``events.jsonl``: resumes, stops and checkpoints (:mod:`hetseq_hpc.rundir.events`)."""
        return self.root / self.EVENTS_NAME

    @property
    def metrics_csv(self) -> Path:
        """``metrics.csv`` (``trainer.loggers=[csv]``)."""
        return self.root / "metrics.csv"

    @property
    def allocation(self) -> Path:
        """``allocation.json``."""
        return self.root / "allocation.json"

    @property
    def summary(self) -> Path:
        """``summary.json``."""
        return self.root / "summary.json"

    @property
    def plot(self) -> Path:
        """``ranks.png``."""
        return self.root / "ranks.png"

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``."""
        return self.root / "checkpoints"

    @property
    def previous(self) -> Path:
        """``previous/``: earlier runs' records."""
        return self.root / "previous"

    @property
    def logs(self) -> Path:
        """``logs/``."""
        return self.root / "logs"

    @property
    def cli_log(self) -> Path:
        """``cli.log``: the launcher's log."""
        return self.root / "cli.log"

    @property
    def lock(self) -> Path:
        """``.hetseq.lock``."""
        return self.root / self.LOCK_NAME

    def rank_log(self, rank: int) -> Path:
        """``logs/rank<N>.log``."""
        return self.logs / f"rank{int(rank)}.log"

    def error_file(self, rank: int) -> Path:
        """``logs/rank<N>.error.json``: a failed rank's one-line reason (launchers read it)."""
        return self.logs / f"rank{int(rank)}.error.json"

    def emulation_file(self, rank: int) -> Path:
        """``logs/rank<N>.emulation.json``: how a rank's speed was emulated."""
        return self.logs / f"rank{int(rank)}.emulation.json"


__all__ = ["RunDir"]
