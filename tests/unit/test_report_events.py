"""The report shows what happened to a run, in-process: a real Trainer (world size 1, real
gloo, ``task=dataset``) stopped by a stop request and resumed writes ``events.jsonl``; the
text summary lists the stop, the resume and the checkpoints with their steps, and the
Figure marks them (its artists are inspected, not pixels). Ranks with the same share are
told apart, and a panel with nothing clipped says nothing about clipping."""

from __future__ import annotations

import json

import matplotlib
import pytest
import torch

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.env.preemption import REASONS, TERMINATE
from hetseq_hpc.errors import Preempted
from hetseq_hpc.report.figure import EVENT_STYLES, build_figure
from hetseq_hpc.report.plots import run_figure, text_summary
from hetseq_hpc.rundir.events import append_event, read_events
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.records import RankMeta
from hetseq_hpc.train.trainer import Trainer

matplotlib.use("Agg")
import matplotlib.pyplot as plt

B = 8


class _Stop:
    """A stop request already received (as SIGTERM sets it: :class:`StopRequest`)."""

    code = TERMINATE


def _trainer(rdv, run_dir, samples, stop=None, *overrides):
    run = compose_run_config(
        [
            "task=dataset",
            "task.target=tests.helpers.user_dataset:build",
            "cluster.ranks=1",
            f"trainer.global_batch_size={B}",
            "trainer.max_steps=4",
            "trainer.checkpoint_every=2",
            "trainer.val_every=0",
            *overrides,
        ]
    )
    task = build_task(run.task, run.trainer.seed)
    task.load()
    torch.manual_seed(run.trainer.seed)
    return Trainer(
        run,
        RunDir(run_dir),
        rdv,
        task,
        task.build_model(),
        torch.device("cpu"),
        allocate([1.0], B, [samples]),
        [RankMeta(rank=0, device="cpu", node="test")],
        stop_request=stop,
    )


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory):
    """A run stopped after step 1 (the ranks' stop after the checkpoint, then the row of the
    local launcher that got Ctrl-C), resumed with another micro-batch, trained to step 4."""
    run_dir = tmp_path_factory.mktemp("run")
    with single_process_rendezvous() as rdv:
        with pytest.raises(Preempted):
            _trainer(rdv, run_dir, 8, _Stop()).fit()
        append_event(RunDir(run_dir), "stopped_by", cause="Ctrl-C (SIGINT)")  # the local launcher's
        _trainer(rdv, run_dir, 4).fit()
    return run_dir


def test_the_trainer_records_the_stop_the_resume_and_every_checkpoint(stopped_and_resumed):
    events, damaged = read_events(RunDir(stopped_and_resumed))
    assert damaged == 0
    kinds = [(e["event"], e.get("step")) for e in events]
    assert kinds == [
        ("start", 0),
        ("checkpoint", 1),
        ("stop", 1),
        ("stopped_by", None),
        ("resume", 1),
        ("checkpoint", 2),
        ("checkpoint", 4),
    ]
    stop, resume = events[2], events[4]
    assert stop["code"] == TERMINATE and stop["reason"] == REASONS[TERMINATE]
    assert resume["checkpoint"].endswith("step_00000001.pt") and resume["world_size"] == 1
    assert resume["allocation"] == [8]
    assert {e.get("run_id") for e in events if e["event"] != "stopped_by"} == {resume["run_id"]}


def test_the_summary_lists_the_stop_the_resume_and_the_checkpoints(stopped_and_resumed):
    text = text_summary(stopped_and_resumed)
    assert "stopped after step 1 by Ctrl-C (SIGINT) to the launcher, after its checkpoint" in text
    assert "resumed at step 1 from " in text and "step_00000001.pt on 1 rank(s)" in text
    assert "checkpoints at step(s) 1, 2, 4 (3 in all)" in text
    assert "point(s)" not in text


def _event_lines(ax, kind):
    _, colour, style, _, _ = EVENT_STYLES[kind]
    return [
        line
        for line in ax.get_lines()
        if line.get_linestyle() == style and line.get_color() == colour
    ]


def test_the_figure_marks_the_stop_the_resume_and_the_checkpoints(stopped_and_resumed):
    fig = run_figure(stopped_and_resumed)
    try:
        axes = fig.get_axes()
        for ax in axes:  # a resume and a stop: a vertical line on every panel
            for kind in ("resume", "stop"):
                assert [tuple(x.get_xdata()) for x in _event_lines(ax, kind)] == [(1, 1)], kind
        loss_ax = axes[0]
        legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
        marks = {line.get_label(): list(line.get_xdata()) for line in loss_ax.get_lines()}
        for kind, steps in (("resume", [1]), ("stop", [1]), ("checkpoint", [1, 2, 4])):
            label = EVENT_STYLES[kind][0] + (" (3)" if kind == "checkpoint" else "")
            assert marks[label] == steps and label in legend
    finally:
        plt.close(fig)


def _rows(times, shares):
    """Step rows of len(times[0]) steps, rank i with ``shares[i]`` samples and ``times[i]``."""
    rows = []
    for step in range(len(times[0])):
        ranks = [
            {
                "rank": r,
                "device": "cpu",
                "micro_batch": shares[r],
                "accum_steps": 1,
                "samples": shares[r],
                "compute_time_s": times[r][step],
            }
            for r in range(len(times))
        ]
        rows.append({"step": step + 1, "loss": 1.0, "samples_per_s": 10.0, "ranks": ranks})
    return rows


def test_ranks_with_the_same_share_are_drawn_apart_and_named():
    """Ranks 0 and 1 have the same share at every step: rank 1 is dashed with markers and its
    legend entry says so; rank 2 shares rank 1's only at the first 3 of 8 steps: dotted."""
    rows = _rows([[1.0] * 8, [1.0] * 8, [2.0] * 8], [8, 8, 8])
    for row in rows[3:]:
        row["ranks"][2]["samples"] = 16
    fig = build_figure(rows)
    try:
        share_ax = fig.get_axes()[2]
        lines = {
            line.get_label(): line
            for line in share_ax.get_lines()
            if line.get_label().startswith("rank")
        }
        third = "rank 2 (cpu) (same share as rank 0 at 3 of 8 steps, rank 1 at 3 of 8 steps)"
        assert sorted(lines) == ["rank 0 (cpu)", "rank 1 (cpu) (same share as rank 0)", third]
        first, twin = lines["rank 0 (cpu)"], lines["rank 1 (cpu) (same share as rank 0)"]
        assert first.get_linestyle() == "-" and first.get_marker() in ("None", None, "")
        assert twin.get_linestyle() == "--" and twin.get_marker() == "o"
        assert lines[third].get_linestyle() == ":" and lines[third].get_marker() == "s"
        legend = [t.get_text() for t in share_ax.get_legend().get_texts()]
        assert "rank 1 (cpu) (same share as rank 0)" in legend
    finally:
        plt.close(fig)


def test_no_clipping_note_when_no_point_is_clipped():
    """Rank 0's one slow step (3x its neighbours) is a spike, yet under rank 1's steady level:
    the panel ends above both and no point is hidden, so no "0 point(s) above" note."""
    fast = [1.0] * 8
    fast[4] = 3.5
    fig = build_figure(_rows([fast, [4.0] * 8], [8, 8]))
    try:
        time_ax = fig.get_axes()[3]
        assert time_ax.get_ylim()[1] >= 3.5
        assert not [t.get_text() for t in time_ax.texts if "point(s)" in t.get_text()]
    finally:
        plt.close(fig)


def test_a_damaged_events_file_does_not_stop_the_report(tmp_path):
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"event": "checkpoint", "step": 2}) + '\n{"event": "resu\n[1]\n'
    )
    events, damaged = read_events(RunDir(tmp_path))
    assert [e["step"] for e in events] == [2] and damaged == 2
