"""Placement of a rank (threads, emulated speed, memory budget, partition, precision) from the
config and its place in the job; the local launcher's rank environments. Pure: nothing starts."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from hetseq_hpc.balance.memory import memory_budget_bytes
from hetseq_hpc.balance.placement import (
    RankPlacement,
    calibration_micro_batch,
    cpu_threads,
    emulated_cpus,
    placement_for,
    plan_placements,
)
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.config.balance import BalanceConfig
from hetseq_hpc.config.trainer import TrainerConfig
from hetseq_hpc.env.emulation import PERIOD_US, cfs_quota_us
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.launch.local import rank_environments
from hetseq_hpc.worker import rank_placement

TORCH_VARS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
}
#: the values the local launcher used to pass to the worker through the environment
GONE = {"HETSEQ_THREADS", "HETSEQ_EMULATE_SPEED", "HETSEQ_MEMORY_BUDGET_GB"}


def _run(*overrides):
    return compose_run_config(list(overrides))


# --------------------------------------------------------------------------- cluster=local
def test_local_threads_split_the_cores_between_the_ranks():
    run = _run("cluster.ranks=2")
    assert [p.threads for p in plan_placements(run, cores=8)] == [4, 4]
    assert [p.threads for p in plan_placements(run, cores=3)] == [1, 1]
    assert placement_for(run, 1, cores=8).ranks_on_node == 2


def test_local_threads_per_rank_wins():
    run = _run("cluster.ranks=2", "cluster.threads_per_rank=3")
    assert [p.threads for p in plan_placements(run, cores=64)] == [3, 3]
    # a scheduler's cpus-per-task does not override an explicit local setting
    assert placement_for(run, 0, cpus_per_task=7, cores=64).threads == 3


def test_more_local_ranks_than_cores_get_one_thread_and_a_warning(caplog):
    run = _run("cluster.ranks=5")
    with caplog.at_level(logging.WARNING, logger="hetseq_hpc.balance.placement"):
        placements = plan_placements(run, cores=2)
    assert [p.threads for p in placements] == [1] * 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "5 ranks on 2 CPU core(s)" in warnings[0]


def test_local_speeds_budget_and_precision_per_rank():
    run = _run(
        "cluster.ranks=3",
        "cluster.speeds=[1.0,0.5,0.25]",
        "cluster.memory_budget_gb=2",
        "precision.default=fp32",
    )
    placements = plan_placements(run, cores=6)
    assert [p.emulate_speed for p in placements] == [1.0, 0.5, 0.25]
    assert [p.emulated_cpus for p in placements] == [2.0, 1.0, 0.5]
    assert {p.memory_budget_gb for p in placements} == {2.0}
    assert {p.precision for p in placements} == {"fp32"}
    assert {(p.partition_key, p.partition, p.gres, p.het_group) for p in placements} == {
        (None, None, None, None)
    }


def test_local_defaults_are_full_speed_and_no_budget():
    placement = placement_for(_run("cluster.ranks=2"), 0, cores=2)
    assert placement == RankPlacement(
        rank=0,
        threads=1,
        emulate_speed=1.0,
        memory_budget_gb=None,
        ranks_on_node=2,
        partition_key=None,
        partition=None,
        gres=None,
        precision="auto",
        het_group=None,
    )


# --------------------------------------------------------------------------- SLURM
def test_het_group_selects_the_partition():
    run = _run("cluster=mixed")
    for group, key, threads in [(0, "a100", 8), (1, "v100", 6), (2, "t4", 4)]:
        placement = placement_for(run, 0, het_group=group, cores=64)
        assert (placement.partition_key, placement.partition, placement.gres) == (key, key, key)
        assert placement.het_group == group and placement.threads == threads


def test_slurm_placements_follow_srun_rank_order():
    placements = plan_placements(_run("cluster=mixed"), cores=1)
    assert len(placements) == 16
    assert [p.partition_key for p in placements] == ["a100"] * 4 + ["v100"] * 8 + ["t4"] * 4
    assert [p.het_group for p in placements] == [0] * 4 + [1] * 8 + [2] * 4
    assert [p.ranks_on_node for p in (placements[0], placements[4], placements[15])] == [4, 4, 2]


def test_slurm_cpus_per_task_and_memory_budgets():
    run = _run(
        "cluster=mixed",
        "cluster.memory_budget_gb=40",
        "cluster.partitions.t4.memory_budget_gb=15",
        "cluster.partitions.v100.emulate_speed=0.5",
    )
    assert placement_for(run, 0, het_group=0, cpus_per_task=2, cores=64).threads == 2
    assert placement_for(run, 0, het_group=0).memory_budget_gb == 40.0  # the cluster's
    assert placement_for(run, 0, het_group=2).memory_budget_gb == 15.0  # the partition's wins
    v100 = placement_for(run, 5, het_group=1, cores=64)
    assert v100.emulate_speed == 0.5 and v100.emulated_cpus == 3.0


def test_worker_resolves_its_placement_from_its_world():
    run = _run("cluster=testcluster")
    world = WorldInfo(
        rank=2,
        local_rank=0,
        world_size=3,
        master_addr="n1",
        master_port=29500,
        source="slurm",
        het_group=1,
        het_size=2,
        partition="v100",
        cpus_per_task=1,
    )
    placement = rank_placement(run, world, env={})
    assert (placement.partition_key, placement.gres, placement.threads) == ("v100", "v100", 1)
    local = _run("cluster.ranks=2", "cluster.speeds=[1.0,0.35]")
    world = WorldInfo(
        rank=1,
        local_rank=1,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=29500,
        source="torch",
    )
    placement = rank_placement(local, world, env={"LOCAL_WORLD_SIZE": "2"})
    assert placement.emulate_speed == 0.35 and placement.ranks_on_node == 2


# --------------------------------------------------------------------------- formulas
def test_memory_budget_bytes():
    configured = placement_for(_run("cluster.ranks=2", "cluster.memory_budget_gb=0.5"), 0)
    assert memory_budget_bytes(configured, "cpu", 64 * 2**30, 2) == 0.5 * 2**30
    assert memory_budget_bytes(configured, "cuda", 64 * 2**30, 2) == 0.5 * 2**30
    free = placement_for(_run("cluster.ranks=2"), 0)
    assert memory_budget_bytes(free, "cuda", 10 * 2**30, 4) == 10 * 2**30  # a GPU is not shared
    assert memory_budget_bytes(free, "cpu", 10 * 2**30, 4) == 2.5 * 2**30  # RAM is


@pytest.mark.parametrize(
    "batch, configured, world, expected",
    [(32, None, 2, 16), (64, None, 2, 16), (12, None, 3, 4), (3, None, 4, 1), (32, 5, 2, 5)],
)
def test_calibration_micro_batch(batch, configured, world, expected):
    run = SimpleNamespace(
        trainer=TrainerConfig(global_batch_size=batch),
        balance=BalanceConfig(calibration_micro_batch=configured),
    )
    assert calibration_micro_batch(run, world) == expected


@pytest.mark.parametrize(
    "batch, configured, expected", [(512, None, 256), (256, None, 128), (1024, 8, 8), (2, None, 1)]
)
def test_calibration_micro_batch_on_a_gpu_is_the_share_up_to_256(batch, configured, expected):
    """On a GPU the default is the rank's share up to 256: at 16 samples a GPU times its kernel
    launches (measured on an H100, docs/benchmarks.md)."""
    run = SimpleNamespace(
        trainer=TrainerConfig(global_batch_size=batch),
        balance=BalanceConfig(calibration_micro_batch=configured),
    )
    assert calibration_micro_batch(run, 2, "cuda") == expected
    assert calibration_micro_batch(run, 2, "cpu") == (configured or min(16, max(1, batch // 2)))


def test_thread_and_quota_formulas():
    assert cpu_threads(16, 4) == 4 and cpu_threads(16, 4, configured=2) == 2
    assert cpu_threads(2, 3, warn=False) == 1
    assert emulated_cpus(0.25, 4) == 1.0 and emulated_cpus(0.5, 0) == 0.5
    assert cfs_quota_us(1.0) == PERIOD_US and cfs_quota_us(0.0001) == 1000


# --------------------------------------------------------------------------- rank environments
def test_local_rank_environments_carry_only_torch_variables(tmp_path, monkeypatch):
    for name in GONE:
        monkeypatch.delenv(name, raising=False)
    run = _run(
        "cluster.ranks=3",
        "cluster.speeds=[1.0,0.5,0.25]",
        "cluster.memory_budget_gb=1",
        "cluster.master_port=29555",
        "cluster.threads_per_rank=2",
    )
    envs = rank_environments(run, tmp_path / "hetseq_config.yaml")
    assert len(envs) == 3
    for rank, env in enumerate(envs):
        assert set(env) >= TORCH_VARS
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "3",
            "3",
        )
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == (
            "127.0.0.1",
            "29555",
            "2",
        )
        assert not GONE & set(env), "the worker resolves speed, threads and budget itself"
