"""Reading back what ``trainer.loggers`` wrote: TensorBoard events (with tensorboard's own
EventAccumulator), metrics.csv, and the loggers' warnings."""

from __future__ import annotations

import csv
from pathlib import Path

from hetseq_hpc.train.metrics.loggers import CSV_NAME, TB_DIR

LOGGERS = "trainer.loggers=[jsonl,csv,tensorboard]"


def events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TB_DIR), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar_steps(acc, tag):
    return [e.step for e in acc.Scalars(tag)]


def csv_rows(run_dir: Path):
    with open(run_dir / CSV_NAME, newline="") as fh:
        return list(csv.DictReader(fh))


def logger_warnings(text: str, path: Path) -> list:
    """The lines of ``text`` in which ``trainer.loggers`` warns about ``path``."""
    return [line for line in text.splitlines() if "trainer.loggers:" in line and str(path) in line]
