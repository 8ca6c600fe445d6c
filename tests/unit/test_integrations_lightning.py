"""HetSeqStrategy's parts that need no second process: the refusals (each one line naming the
setting and the fix), checked on real Lightning Trainers and modules; the tested-version gate;
the het-job cluster environment against the environment a real Slurm 22.05 het job gives its
tasks (docs/design/slurm-launch.md), next to Lightning's own SLURMEnvironment, which gets it
wrong."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

from hetseq_hpc.errors import ConfigError
from tests.helpers.optional import import_or_skip

#: Lightning is imported by the first test (tests/helpers/lightning_parts.py), on the one
#: worker this group runs on, not while every worker collects the suite
pytestmark = pytest.mark.xdist_group("lightning")


@pytest.fixture(autouse=True)
def lp() -> ModuleType:
    """tests/helpers/lightning_parts.py, once Lightning imports (outside CI its absence skips
    the test, naming the extra)."""
    import_or_skip("lightning", "lightning")
    return importlib.import_module("tests.helpers.lightning_parts")


#: task 2 of a het job: component 0 = 1 task on n3, component 1 = 2 tasks on n1 (the merged
#: list is sorted by name, so it starts with n1, where rank 0 does NOT run)
HET_TASK_2 = {
    "SLURM_JOB_ID": "17",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "3",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_HET_SIZE": "2",
    "SLURM_NTASKS_HET_GROUP_0": "1",
    "SLURM_NTASKS_HET_GROUP_1": "2",
    "SLURM_JOB_NODELIST": "n[1,3]",
    "SLURM_NODELIST": "n[1,3]",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n3",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n1",
    "SLURM_JOB_NAME": "hetseq",
}


def test_het_job_environment_names_rank_0s_node_where_lightnings_does_not(lp, monkeypatch):
    env = lp.HetJobEnvironment(HET_TASK_2)
    assert (env.global_rank(), env.local_rank(), env.world_size()) == (2, 1, 3)
    assert env.main_address == "n3"  # het component 0's node: where rank 0 runs
    assert env.main_port == 15000 + 17
    assert env.creates_processes_externally
    env.set_global_rank(0)  # node rank x devices + local rank: ignored
    env.set_world_size(2)
    assert (env.global_rank(), env.world_size()) == (2, 3)
    env.validate_settings(num_devices=1, num_nodes=1)  # devices do not shape the world
    for name in list(HET_TASK_2):
        monkeypatch.delenv(name, raising=False)
    for name, value in HET_TASK_2.items():
        monkeypatch.setenv(name, value)
    assert lp.SLURMEnvironment().main_address == "n1"  # Lightning's: the merged list's first node
    assert lp.launched_for_us()


def test_one_task_asked_for_several_devices_is_refused(lp):
    single = {**HET_TASK_2, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}
    del single["SLURM_HET_SIZE"]
    env = lp.HetJobEnvironment(single)
    with pytest.raises(ConfigError, match="devices=2, num_nodes=1 but the job started 1 task"):
        env.validate_settings(num_devices=2, num_nodes=1)


def test_torchrun_and_plain_scripts_keep_lightnings_environments(lp):
    launched_for_us = lp.launched_for_us
    assert not launched_for_us({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert not launched_for_us({"LOCAL_RANK": "1", "WORLD_SIZE": "2"})  # Lightning's children
    assert not launched_for_us({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "5"})
    assert launched_for_us({"RANK": "1", "WORLD_SIZE": "3"})


def test_lightning_outside_the_tested_range_is_refused(lp):
    check_lightning_version = lp.check_lightning_version
    check_lightning_version("2.6.6")
    with pytest.raises(
        ConfigError,
        match=r"lightning 2\.5\.0 is outside the range .*>=2\.6,<2\.7.*pip install 'hetseq_hpc\[lightning\]'",
    ):
        check_lightning_version("2.5.0")
    with pytest.raises(ConfigError, match=r"lightning 2\.7\.0 is outside"):
        check_lightning_version("2.7.0")


@pytest.mark.parametrize(
    ("kwargs", "module", "words"),
    [
        (
            {"accumulate_grad_batches": 2},
            None,
            r"Trainer\(accumulate_grad_batches=2\) .* leave it at 1 and set global_batch_size",
        ),
        (
            {"sync_batchnorm": True, "devices": 2},
            None,
            r"Trainer\(sync_batchnorm=True\) .* use nn\.GroupNorm or nn\.LayerNorm",
        ),
        (
            {},
            "WithBatchNorm",
            r"model layer 'net\.1' is BatchNorm1d: .* HetSeqStrategy\(allow_batchnorm=True\)",
        ),
        ({}, "Manual", r"automatic_optimization=False .* use automatic optimisation"),
        (
            {"plugins": ["fp16_mixed"]},
            None,
            r"fp16 keeps one GradScaler per rank.*bf16-mixed",
        ),
        (
            {},
            "BeforeTransfer",
            r"on_before_batch_transfer .* move it into the DataLoader's collate_fn",
        ),
    ],
)
def test_what_uneven_exact_batches_cannot_do_is_refused_in_one_line(lp, kwargs, module, words):
    """The modules and plugins are named (tests/helpers/lightning_parts.py): the parameters
    are made at collection, before Lightning is imported."""
    if "plugins" in kwargs:
        kwargs = {**kwargs, "plugins": [getattr(lp, name)() for name in kwargs["plugins"]]}
    trainer = lp.trainer(getattr(lp, module)() if module else None, **kwargs)
    with pytest.raises(ConfigError, match=words) as info:
        trainer.strategy.refuse_unsupported(trainer)
    assert "\n" not in str(info.value)


def test_batchnorm_opt_out_and_a_clean_module_pass(lp):
    strategy = lp.HetSeqStrategy(global_batch_size=8, allow_batchnorm=True)
    trainer = lp.trainer(lp.WithBatchNorm(), strategy=strategy)
    trainer.strategy.refuse_unsupported(trainer)
    trainer = lp.trainer()
    trainer.strategy.refuse_unsupported(trainer)


def test_bad_strategy_arguments_are_refused_in_one_line(lp):
    HetSeqStrategy = lp.HetSeqStrategy
    with pytest.raises(
        ConfigError,
        match=r"HetSeqStrategy\(ddp_comm_hook=...\): the strategy registers its own SUM",
    ):
        HetSeqStrategy(global_batch_size=8, ddp_comm_hook=lambda s, b: None)
    with pytest.raises(ConfigError, match="units_fn=3 is not callable"):
        HetSeqStrategy(global_batch_size=8, units_fn=3)
    with pytest.raises(ConfigError, match="global_batch_size='32' is invalid"):
        HetSeqStrategy(global_batch_size="32")


def test_a_micro_batch_that_returns_no_loss_is_refused(lp):
    step_loss = lp.step_loss
    assert step_loss({"loss": torch.tensor(1.0)}, "x").item() == 1.0
    with pytest.raises(
        ConfigError,
        match=r"training_step returned NoneType for micro-batch 2: .* cannot be skipped on one rank alone",
    ):
        step_loss(None, "micro-batch 2")


def test_in_a_het_job_every_task_gets_a_device_and_the_samplers_span_the_job(lp):
    """Lightning's own: devices=1 on a node's second task indexes past the device list."""
    strategy = lp.HetSeqStrategy(
        global_batch_size=8, cluster_environment=lp.HetJobEnvironment(HET_TASK_2)
    )
    trainer = lp.trainer(strategy=strategy)
    assert trainer.strategy.local_rank == 1 and trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 2}
