"""Every file of a run directory, named in one place (submitit's ``JobPaths`` is the model).

A run directory (``hydra.run.dir``, default ``outputs/<date>/<time>/``) holds::

    hetseq_config.yaml      the resolved configuration the workers ran (resume reads it)
    run.json                the current run's id (train/checkpoints and metrics rows carry it)
    metrics.jsonl           one JSON object per logged step (rank 0); metrics.csv, tb/, wandb_id.txt
    events.jsonl            resumes, stops, checkpoints, start-overs (rundir/events.py)
    allocation.json         the agreed split and every rank's start-up report
    summary.json            final figures; ranks.png the per-rank picture
    checkpoints/            step_XXXXXXXX.pt + .sha256 (+ .shards/ of FSDP runs); corrupt/
    previous/<run id>/      an earlier run's records, moved there when a new run started
    logs/                   rank<N>.log, rank<N>.error.json, stop.json, the prepare markers
    cli.log, .hydra/        the launcher's log, Hydra's record of a new run's command line
    job.json, job.sbatch    a SLURM job's id and script; submitit/, when.json (cluster.choose)
    .hetseq.lock            one run at a time (flock)

Code takes a :class:`RunDir` where it needs a run directory and asks it for a path; no file
name of a run directory is spelled anywhere else (tests/unit/test_rundir_names.py checks it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, List, Tuple, Union


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory; nothing is created by building it.

    Built once where a run directory enters the program (the command line's run, a worker's
    ``--config``, a report or export command's folder) and passed down. ``str()`` and
    ``os.fspath()`` give the directory itself, so it reads as the path in messages.

    Args:
        root: the run directory (``hydra.run.dir``).
    """

    root: Path

    CONFIG_NAME = "hetseq_config.yaml"
    METRICS_NAME = "metrics.jsonl"
    EVENTS_NAME = "events.jsonl"
    LOCK_NAME = ".hetseq.lock"
    RUN_FILE = "run.json"
    CSV_NAME = "metrics.csv"
    TB_NAME = "tb"
    WANDB_ID_NAME = "wandb_id.txt"
    WANDB_NAME = "wandb"
    SUMMARY_NAME = "summary.json"
    ALLOCATION_NAME = "allocation.json"
    PLOT_NAME = "ranks.png"
    CHECKPOINTS_NAME = "checkpoints"
    #: a checkpoint folder's subfolder for files that failed verification
    CORRUPT_NAME = "corrupt"
    PREVIOUS_NAME = "previous"
    LOGS_NAME = "logs"
    CLI_LOG_NAME = "cli.log"
    HYDRA_NAME = ".hydra"
    JOB_NAME = "job.json"
    SBATCH_NAME = "job.sbatch"
    SUBMITIT_NAME = "submitit"
    WHEN_NAME = "when.json"
    #: the SLURM launcher's record of why it stopped a job (relative to the run directory)
    STOP_RECORD = Path(LOGS_NAME) / "stop.json"
    #: ``hetseq-hpc export``'s default targets: one safetensors file, a transformers directory
    EXPORT_FILE_NAME = "model.safetensors"
    EXPORT_DIR_NAME = "hf_model"
    #: the records of one run, moved together to ``previous/<run id>/`` on start-over
    RUN_RECORDS: ClassVar[Tuple[str, ...]] = (
        CHECKPOINTS_NAME,
        METRICS_NAME,
        EVENTS_NAME,
        CSV_NAME,
        TB_NAME,
        SUMMARY_NAME,
        ALLOCATION_NAME,
        PLOT_NAME,
        WANDB_ID_NAME,
        RUN_FILE,
    )

    def __init__(self, root: Union[str, Path, RunDir]):
        object.__setattr__(self, "root", Path(root))

    def __str__(self) -> str:
        return str(self.root)

    def __fspath__(self) -> str:
        return os.fspath(self.root)

    def resolve(self) -> RunDir:
        """The same run directory as an absolute path, symbolic links resolved."""
        return RunDir(self.root.resolve())

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
        return self.root / self.CSV_NAME

    @property
    def tensorboard(self) -> Path:
        """``tb/``: TensorBoard's event files (``trainer.loggers=[tensorboard]``)."""
        return self.root / self.TB_NAME

    @property
    def wandb_id(self) -> Path:
        """``wandb_id.txt``: the W&B run id, kept so a resume logs to the same W&B run."""
        return self.root / self.WANDB_ID_NAME

    @property
    def wandb(self) -> Path:
        """``wandb/``: W&B's own files (``trainer.loggers=[wandb]``)."""
        return self.root / self.WANDB_NAME

    @property
    def allocation(self) -> Path:
        """``allocation.json``."""
        return self.root / self.ALLOCATION_NAME

    @property
    def summary(self) -> Path:
        """``summary.json``."""
        return self.root / self.SUMMARY_NAME

    @property
    def plot(self) -> Path:
        """``ranks.png``."""
        return self.root / self.PLOT_NAME

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``."""
        return self.root / self.CHECKPOINTS_NAME

    @property
    def previous(self) -> Path:
        """``previous/``: earlier runs' records."""
        return self.root / self.PREVIOUS_NAME

    @property
    def logs(self) -> Path:
        """``logs/``."""
        return self.root / self.LOGS_NAME

    @property
    def cli_log(self) -> Path:
        """``cli.log``: the launcher's log."""
        return self.root / self.CLI_LOG_NAME

    @property
    def hydra(self) -> Path:
        """``.hydra/``: what Hydra records of a new run (its config and command line)."""
        return self.root / self.HYDRA_NAME

    @property
    def hydra_overrides(self) -> Path:
        """``.hydra/overrides.yaml``: the overrides a new run was started with."""
        return self.hydra / "overrides.yaml"

    @property
    def lock(self) -> Path:
        """``.hetseq.lock``."""
        return self.root / self.LOCK_NAME

    @property
    def job(self) -> Path:
        """``job.json``: the SLURM job a run submitted (its id, ranks, folder)."""
        return self.root / self.JOB_NAME

    @property
    def sbatch(self) -> Path:
        """``job.sbatch``: the batch script ``hetseq-hpc render`` (``cluster.render_only``)
        writes."""
        return self.root / self.SBATCH_NAME

    @property
    def submitit(self) -> Path:
        """``submitit/``: submitit's scripts, pickles and logs (``cluster.folder`` default)."""
        return self.root / self.SUBMITIT_NAME

    @property
    def when(self) -> Path:
        """``when.json``: the partition mixes ``cluster.choose`` planned, and its pick."""
        return self.root / self.WHEN_NAME

    @property
    def stop_record(self) -> Path:
        """``logs/stop.json``: why the SLURM launcher stopped the job."""
        return self.root / self.STOP_RECORD

    @property
    def export_file(self) -> Path:
        """``model.safetensors``: ``hetseq-hpc export``'s default file."""
        return self.root / self.EXPORT_FILE_NAME

    @property
    def export_dir(self) -> Path:
        """``hf_model/``: ``hetseq-hpc export``'s default directory of a ``task=hf`` run."""
        return self.root / self.EXPORT_DIR_NAME

    def records(self) -> List[Path]:
        """The paths of :data:`RUN_RECORDS` (present or not)."""
        return [self.root / name for name in self.RUN_RECORDS]

    def rank_log(self, rank: int) -> Path:
        """``logs/rank<N>.log``."""
        return self.logs / f"rank{int(rank)}.log"

    def error_file(self, rank: int) -> Path:
        """``logs/rank<N>.error.json``: a failed rank's one-line reason (launchers read it)."""
        return self.logs / f"rank{int(rank)}.error.json"

    def error_files(self) -> List[Path]:
        """Every ``logs/rank<N>.error.json`` there is (an earlier attempt's included)."""
        return sorted(self.logs.glob("rank*.error.json"))

    def emulation_file(self, rank: int) -> Path:
        """``logs/rank<N>.emulation.json``: how a rank's speed was emulated."""
        return self.logs / f"rank{int(rank)}.emulation.json"

    def prepared_marker(self, token: str) -> Path:
        """``logs/.prepared-<token>.json``: rank 0's word that the task's ``prepare()`` ended."""
        return self.logs / f".prepared-{token}.json"

    def prepare_heartbeat(self, token: str) -> Path:
        """``logs/.preparing-<token>.heartbeat``: rank 0's counter while it prepares."""
        return self.logs / f".preparing-{token}.heartbeat"


__all__ = ["RunDir"]
