"""hetseq_hpc.report.plots in-process: the per-rank PNG and the text summary from metrics.jsonl.
(`python -m hetseq_hpc.report` on a folder without metrics: tests/integration/test_report_cli.py.)"""

from __future__ import annotations

import json

import pytest

from hetseq_hpc.errors import HetseqError
from hetseq_hpc.report.plots import plot_run
from hetseq_hpc.train.metrics import read_metrics


def _write_metrics(run_dir, steps=12, realloc_at=6):
    alloc = [20, 8, 4]
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "loss": 8.0 - 0.1 * step,
            "samples_per_s": 300.0,
            "step_time_s": 0.1,
            "allocation": list(alloc),
            "ranks": [],
        }
        for rank, (device, part, speed) in enumerate(
            [
                ("cuda:0 A100", "a100", 400.0),
                ("cuda:0 V100", "v100", 150.0),
                ("cuda:0 T4", "t4", 60.0),
            ]
        ):
            b = alloc[rank]
            row["ranks"].append(
                {
                    "rank": rank,
                    "device": device,
                    "partition": part,
                    "micro_batch": b,
                    "accum_steps": 1,
                    "samples": b,
                    "step_time_s": b / speed + 0.01,
                    "compute_time_s": b / speed,
                }
            )
        if step == realloc_at:
            row["reallocation"] = {"from": list(alloc), "to": [19, 9, 4], "at_step": step + 1}
            alloc = [19, 9, 4]
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_run_writes_a_png(tmp_path):
    _write_metrics(tmp_path)
    path = plot_run(tmp_path)
    assert path == tmp_path / "ranks.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    other = plot_run(tmp_path, tmp_path / "sub" / "x.png")
    assert other.is_file() and other.read_bytes()[:4] == b"\x89PNG"


def test_one_metrics_reader_for_report_and_tests(tmp_path):
    """hetseq_hpc.train.metrics.read_metrics: a last row still being written is skipped, a
    damaged row before it is a one-line error naming the line."""
    good = [json.dumps({"step": 1, "loss": 2.0}), json.dumps({"step": 2, "loss": 1.0})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(good) + '\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert read_metrics(tmp_path / "metrics.jsonl") == read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(good[0] + '\n{"step": 2\n' + good[1] + "\n")
    with pytest.raises(HetseqError, match=r"metrics\.jsonl line 2 is not JSON") as err:
        read_metrics(tmp_path)
    assert "\n" not in str(err.value)


def test_text_summary_names_losses_reallocations_and_every_rank(tmp_path):
    from hetseq_hpc.report.plots import text_summary

    _write_metrics(tmp_path)
    text = text_summary(tmp_path)
    assert "steps 1-12" in text and "loss 7.9000 -> 6.8000" in text
    assert "re-allocation at step 7: [20, 8, 4] -> [19, 9, 4]" in text
    for rank in range(3):
        assert f"rank {rank} (" in text
    assert "19 x 1 = 19 samples/step" in text
