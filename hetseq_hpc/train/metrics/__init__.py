"""What a run reports: ``metrics.jsonl`` and the summary figures (``rows``), the other sinks of
``trainer.loggers`` (``loggers``: CSV, TensorBoard, W&B) and rank 0's record of the run as it
trains (``step_log``). The names other packages read are here."""

from hetseq_hpc.train.metrics.rows import (
    METRICS_NAME,
    MetricsWriter,
    Progress,
    measured_step_sync,
    read_metrics,
    run_summary,
    step_row,
)

__all__ = [
    "METRICS_NAME",
    "MetricsWriter",
    "Progress",
    "measured_step_sync",
    "read_metrics",
    "run_summary",
    "step_row",
]
