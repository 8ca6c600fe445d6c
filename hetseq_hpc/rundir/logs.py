"""Per-rank logging: every rank logs everything to ``<run dir>/logs/rank<N>.log``; on the
console rank 0 shows INFO and the other ranks only warnings and errors (nothing is silenced by
patching ``print``, as HetSeq did)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

from hetseq_hpc.rundir.paths import RunDir

FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_rank_logging(
    rank: int, run_dir: Optional[Path], level: int = logging.INFO
) -> Optional[Path]:
    """Configure the root logger of a worker process; returns the log file path."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(level)
    formatter = logging.Formatter(FORMAT, datefmt="%H:%M:%S")
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level if rank == 0 else logging.WARNING)
    console.addFilter(_RankFilter(rank))
    console.setFormatter(formatter)
    root.addHandler(console)
    path = None
    if run_dir is not None:
        path = RunDir(run_dir).rank_log(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path, encoding="utf-8")
        fh.setLevel(level)
        fh.addFilter(_RankFilter(rank))
        fh.setFormatter(formatter)
        root.addHandler(fh)
    for noisy in ("urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return path
