"""The Fabric and accelerate helpers' refusals and the SUM hook's registration, in-process
(real Fabric, Accelerator and DDP objects; the runs themselves: tests/integration/
test_fabric_accelerate.py)."""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.errors import ConfigError
from tests.helpers.optional import import_or_skip

#: Lightning is imported by the first test, on the one worker this group runs on, not while
#: every worker collects the suite (~5 CPU-s each)
pytestmark = pytest.mark.xdist_group("lightning")


@pytest.fixture(autouse=True)
def L():
    """``lightning``, for every test of the module (outside CI its absence skips the test,
    naming the extra)."""
    return import_or_skip("lightning", "lightning")


def test_a_model_that_is_not_ddp_needs_no_hook():
    from hetseq_hpc.integrations.loop import register_sum_hook

    assert register_sum_hook(torch.nn.Linear(2, 2)) is None


def test_ddp_gets_the_sum_hook_once_and_a_second_hook_is_refused():
    from torch.nn.parallel import DistributedDataParallel

    from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
    from hetseq_hpc.integrations.loop import register_sum_hook

    with single_process_rendezvous():
        ddp = DistributedDataParallel(torch.nn.Linear(2, 1))
        assert register_sum_hook(ddp) is not None
        with pytest.raises(ConfigError, match="already has a communication hook"):
            register_sum_hook(ddp)


def test_fabric_without_the_hetseq_strategy_is_refused_in_one_line(L):
    from hetseq_hpc.integrations.fabric import HetSeqFabric

    fabric = L.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(
        ConfigError,
        match=r"Fabric\(strategy=SingleDeviceStrategy\) with HetSeqFabric: pass .*HetSeqFabricStrategy\(\)",
    ):
        HetSeqFabric(fabric, global_batch_size=8)


def test_the_fabric_strategy_injects_no_sampler():
    from hetseq_hpc.integrations.fabric import HetSeqFabricStrategy

    assert HetSeqFabricStrategy().distributed_sampler_kwargs is None


def test_accelerate_with_its_own_accumulation_is_refused_in_one_line():
    accelerate = import_or_skip("accelerate", "accelerate")
    from hetseq_hpc.integrations.accelerate import HetSeqAccelerate

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=2\) .* leave it at 1"):
        HetSeqAccelerate(accelerator, torch.nn.Linear(2, 1), global_batch_size=8)
