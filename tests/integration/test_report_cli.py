"""`python -m hetseq_hpc.report` on a run directory without metrics.jsonl: one error line."""

from __future__ import annotations

import pytest

from hetseq_hpc.errors import HetseqError
from hetseq_hpc.report.plots import plot_run
from tests.helpers.runs import hetseq


def test_missing_metrics_is_one_line_error(tmp_path):
    with pytest.raises(HetseqError, match=r"metrics\.jsonl does not exist"):
        plot_run(tmp_path)
    proc = hetseq(str(tmp_path), module="hetseq_hpc.report", timeout=60)
    assert proc.returncode == 2  # bad input, as `hetseq-hpc report` (errors.EXIT_CODES)
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("hetseq-report: error:")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(HetseqError, match="no step rows"):
        plot_run(tmp_path)
