"""Per-rank logging: every rank logs everything to ``<run dir>/logs/rank<N>.log``; on the
console rank 0 shows INFO and the other ranks only warnings and errors (nothing is silenced by
patching ``print``, as HetSeq did).

A log file never ends a run: the first record that cannot be written (a full or read-only
filesystem) closes the file with ONE warning on the console, and the process logs to the
console only from then on (:class:`RunLogHandler`; also ``cli.log``, :func:`guard_log_files`).
The writes that matter, ``metrics.jsonl`` and the checkpoints, end the run with the one line.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

from hetseq_hpc.files.fence import may_write
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.rundir.storage import write_problem

FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class RunLogHandler(logging.FileHandler):
    """A log file in the run directory (appended, UTF-8) that never fails its process: the
    first record it cannot write closes it, with one warning to the other handlers (the
    console) naming the file and why (``no space left on <mount>``, ``<mount> is
    read-only``); later records skip it. Other errors (a bad format string) are reported as
    :class:`logging.Handler` does.

    Raises:
        OSError: the file cannot be opened (use :func:`open_run_log` to be warned instead).
    """

    def __init__(self, path: Path):
        super().__init__(path, mode="a", encoding="utf-8")
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record`` unless an earlier write failed, or this rank was left out by the
        others (:func:`hetseq_hpc.files.fence.may_write`: the console still shows it)."""
        if not self.failed and may_write(self.baseFilename):
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """Close the file on a failed write (once, with one warning); else the default."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self.failed = True
        try:
            self.close()  # flushes the rest of the buffer, which fails again
        except OSError:
            pass
        logging.getLogger(__name__).warning(
            "cannot write %s (%s): logging to the console only from now on",
            self.baseFilename,
            write_problem(exc, self.baseFilename) or exc.strerror or exc,
        )


def open_run_log(path: Path, level: int = logging.NOTSET) -> Optional[RunLogHandler]:
    """A :class:`RunLogHandler` on ``path`` (its folder created), or None with one warning when
    it cannot be opened (a read-only or full filesystem): the process logs to the console."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handler = RunLogHandler(path)
    except OSError as exc:
        logging.getLogger(__name__).warning(
            "cannot open %s (%s): logging to the console only",
            path,
            write_problem(exc, path) or exc.strerror or exc,
        )
        return None
    handler.setLevel(level)
    return handler


def guard_log_files(logger: Optional[logging.Logger] = None) -> None:
    """Replace every plain :class:`logging.FileHandler` of ``logger`` (default: the root
    logger; Hydra's ``cli.log``) with a :class:`RunLogHandler` on the same file, with the same
    level, format and filters, so that a full disk cannot fail the launcher through its log."""
    logger = logger or logging.getLogger()
    for old in list(logger.handlers):
        if type(old) is not logging.FileHandler:
            continue
        logger.removeHandler(old)
        try:
            old.close()  # its buffer may already find the disk full
        except OSError:
            pass
        new = open_run_log(Path(old.baseFilename), old.level)
        if new is None:
            continue
        new.setFormatter(old.formatter)
        for flt in old.filters:
            new.addFilter(flt)
        logger.addHandler(new)


def setup_rank_logging(
    rank: int, run_dir: Optional[RunDir], level: int = logging.INFO
) -> Optional[Path]:
    """Configure the root logger of a worker process; returns the log file path (its file
    is left out, with one warning, when it cannot be opened: :func:`open_run_log`)."""
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
        path = run_dir.rank_log(rank)
        fh = open_run_log(path, level)
        if fh is not None:
            fh.addFilter(_RankFilter(rank))
            fh.setFormatter(formatter)
            root.addHandler(fh)
    for noisy in ("urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return path
