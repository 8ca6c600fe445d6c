"""``python -m hetseq_hpc.report RUN_DIR [--out FILE]`` (= ``hetseq-hpc report``)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from hetseq_hpc.errors import HetseqError, report_error
from hetseq_hpc.report.plots import plot_run


def report_command(argv: Optional[List[str]] = None) -> int:
    """``python -m hetseq_hpc.report RUN_DIR [--out FILE]``; exit 0, or the code of :data:`hetseq_hpc.errors.EXIT_CODES` after a one-line error."""
    parser = argparse.ArgumentParser(
        prog="python -m hetseq_hpc.report", description="Plot per-rank step times of a run."
    )
    parser.add_argument("run_dir", help="run directory with metrics.jsonl")
    parser.add_argument("--out", help="PNG to write (default RUN_DIR/ranks.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except HetseqError as exc:
        return report_error(exc, "hetseq-report")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(report_command())
