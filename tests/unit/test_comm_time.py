"""The step's measured gradient communication (issue 46): every bucket collective of the DDP
hooks timed from launch to completion, recorded in the step's row as ``allreduce_s`` (time
with a collective in flight) and ``allreduce_exposed_s`` (after the backward pass)."""

from __future__ import annotations

import pytest

from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.train.ddp_hooks import HookState
from hetseq_hpc.train.parallel import Replicated
from tests.helpers.trainers import one_rank_trainer


def test_overlapping_spans_count_once_and_the_exposed_part_starts_at_the_last_ready_bucket():
    state = HookState()
    assert state.comm_row() == {}  # no collective: no field
    state.comm_spans = [(1.5, 3.0), (1.0, 2.0), (5.0, 6.0)]
    state.last_ready_s = 4.0
    assert state.comm_row() == {"allreduce_s": 3.0, "allreduce_exposed_s": 2.0}
    state.reset()
    assert state.comm_row() == {} and state.last_ready_s == 0.0


def test_a_real_step_records_its_all_reduce_time_in_the_row(tmp_path, token_cache, monkeypatch):
    """One step on a real gloo group: the hook's all-reduce is timed and the row carries it,
    within the step's own wall time. (One rank is wrapped in DDP here, as a world of several
    is, to run its hooks in-process.)"""
    monkeypatch.setattr(Replicated, "wrap_one_rank", True)
    with single_process_rendezvous() as rdv:
        trainer = one_rank_trainer(tmp_path, rdv, token_cache, global_batch=4, cap=2)
        rec = trainer.train_step(1)
    row = rec.grad_path
    assert set(row) >= {"allreduce_s", "allreduce_exposed_s"}, row
    assert 0.0 < row["allreduce_s"] <= rec.wall_s
    assert 0.0 <= row["allreduce_exposed_s"] <= rec.wall_s
    assert trainer.hook_state.comm_spans, "one span per bucket collective"
    assert all(a <= b for a, b in trainer.hook_state.comm_spans)
    assert row == pytest.approx(trainer.hook_state.comm_row())
