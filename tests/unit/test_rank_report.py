"""The start-up report every rank gathers (hetseq_hpc.balance.agree.RankReport): typed parts
on every rank, plain data on the wire, and the split three ranks agree on, in one process
(hetseq_hpc.distributed.gang.FakeGang)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hetseq_hpc.balance.agree import RankReport, agree_on_allocation, write_allocation_json
from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.env.emulation import Emulation
from hetseq_hpc.env.hardware import DeviceProbe
from hetseq_hpc.errors import AllocationError
from hetseq_hpc.rundir.paths import RunDir
from tests.helpers.reports import rank_report

SPEEDS = (10.0, 20.0, 30.0)  # samples/s of ranks 0, 1, 2


def _reports():
    return [rank_report(r, 3, samples_per_s=s, max_micro_batch=8) for r, s in enumerate(SPEEDS)]


def test_a_report_travels_as_plain_data_and_comes_back_typed():
    report = dataclasses.replace(
        rank_report(1, 2),
        probe=DeviceProbe("cuda", "NVIDIA T4", "n1", 0, compute_capability=(7, 5)),
        emulation=Emulation(0.5, "duty-cycle", 1.0, exempt_threads=("gloo",)),
    )
    back = RankReport.of(json.loads(json.dumps(report.to_dict())))  # nothing but plain data
    assert back == report and back.probe.compute_capability == (7, 5)
    assert RankReport.of(report) is report


def test_three_ranks_agree_on_one_allocation_in_one_process():
    """Rank 1 of three: the other ranks' reports arrive as plain data (one all-gather), every
    rank computes the same split from them, and their digests agree."""
    reports = _reports()
    run = compose_run_config(["cluster.ranks=3", "trainer.global_batch_size=12"])
    digest = allocate(list(SPEEDS), 12, [8, 8, 8]).digest()
    gang = FakeGang(
        3,
        rank=1,
        answers=[
            {0: reports[0].to_dict(), 2: reports[2].to_dict()},  # the reports' all-gather
            {0: digest, 2: digest},  # the agreement check
        ],
    )
    gathered = [RankReport.of(r) for r in gang.all_gather_objects(reports[1].to_dict())]
    assert gathered == reports
    allocation = agree_on_allocation(run, gathered, gang)
    assert allocation.samples == [2, 4, 6] and allocation.digest() == digest
    assert [what for what, _ in gang.calls] == ["all_gather_objects"] * 2


def test_a_rank_that_computed_another_split_is_named():
    run = compose_run_config(["cluster.ranks=3", "trainer.global_batch_size=12"])
    digest = allocate(list(SPEEDS), 12, [8, 8, 8]).digest()
    gang = FakeGang(3, rank=0, answers=[{1: digest, 2: "0" * len(digest)}])
    with pytest.raises(AllocationError, match=f"rank 1: {digest}, rank 2: 0+\\)"):
        agree_on_allocation(run, _reports(), gang)


def test_allocation_json_holds_each_ranks_parts_as_before(tmp_path):
    reports = _reports()
    allocation = allocate(list(SPEEDS), 12, [8, 8, 8])
    path = write_allocation_json(RunDir(tmp_path), allocation, reports)
    ranks = json.loads(path.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2] and ranks[2]["device"] == "cpu"
    assert ranks[1]["world"]["rank"] == 1 and ranks[1]["probe"]["kind"] == "cpu"
    assert ranks[2]["calibration"]["samples_per_s"] == 30.0 and ranks[0]["emulation"] is None
    assert ranks[0]["share"]["samples"] == 2
    assert set(ranks[0]) == {
        "rank", "device", "node", "het_group", "partition", "gres", "precision", "compiled",
        "world", "probe", "calibration", "emulation", "share",
    }  # fmt: skip
