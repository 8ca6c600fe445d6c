"""A mixed-device job on one machine (issue 43): ``cluster.devices`` names each rank's device
(one rank on the GPU, one on the CPU), the whole job then joins with gloo, and what cannot
span the two devices is refused in one line.

No GPU is here: where a test needs one it fakes only the GPU count (its name says so); the
mixed job itself runs in tests/gpu/test_mixed_devices_cuda.py on a lent GPU.
"""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.balance.agree import agree_on_sharding, check_device_kinds
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.config.validate import check_devices
from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.distributed.rendezvous import backend_for_job, gloo_for_all
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import AllocationError, ConfigError
from hetseq_hpc.launch import local
from hetseq_hpc.worker import pick_device

GiB = 2.0**30
CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
NCCL = "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize(
    "device, kinds, backend",
    [
        (CUDA, ["cuda", "cpu"], "gloo"),  # the GPU rank of a mixed job: gloo like its peer
        (CPU, ["cuda", "cpu"], "gloo"),  # the CPU rank of the same job
        (CUDA, ["cpu", "cuda", "cuda"], "gloo"),
        (CUDA, ["cuda", "cuda"], NCCL),  # all on GPUs: NCCL for CUDA tensors, as before
        (CPU, ["cpu", "cpu"], "gloo"),
        (CUDA, None, NCCL),  # devices not named: each rank's own device, as before
        (CPU, None, "gloo"),
    ],
)
def test_the_backend_is_one_choice_from_the_whole_jobs_devices(device, kinds, backend):
    assert backend_for_job(device, kinds) == backend
    assert gloo_for_all(kinds) == (backend == "gloo" and kinds is not None)


def test_cluster_devices_sets_the_world_size_and_is_read_back():
    run = compose_run_config(["cluster.devices=[cpu,cpu]"])
    assert run.cluster.planned_world_size() == 2
    assert run.cluster.device_kinds() == ["cpu", "cpu"]
    assert compose_run_config([]).cluster.device_kinds() is None


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["cluster.devices=[gpu,cpu]"], ["cluster.devices[0]='gpu' is unknown", "cuda or cpu"]),
        (
            ["cluster.devices=[cpu,cpu]", "cluster.ranks=3"],
            ["has 2 entries but cluster.ranks is 3", "one device (cuda or cpu) per rank"],
        ),
        (["cluster.devices=[]"], ["cluster.devices=[] is empty", "cluster.devices=null"]),
    ],
)
def test_a_wrong_devices_list_is_one_line_with_the_fix(overrides, words):
    with pytest.raises(ConfigError) as err:
        compose_run_config(overrides)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_cuda_where_torch_has_no_cuda_is_refused_before_anything_starts_no_cuda_here():
    assert not torch.cuda.is_available()  # this machine: a CPU-only torch
    with pytest.raises(ConfigError) as err:
        compose_run_config(["cluster.devices=[cuda,cpu]"])
    text = str(err.value)
    assert "\n" not in text and "cluster.devices=[cuda,cpu] puts a rank on cuda" in text
    assert "torch sees no CUDA GPU here" in text and "use cpu for that rank" in text


def test_fsdp_across_a_gpu_and_a_cpu_rank_is_refused_fake_gpu_count(monkeypatch):
    monkeypatch.setattr("hetseq_hpc.config.validate.visible_gpu_count", lambda: 1)
    with pytest.raises(ConfigError) as err:
        compose_run_config(["cluster.devices=[cuda,cpu]", "sharding.mode=fsdp"])
    text = str(err.value)
    assert "\n" not in text and "sharding.mode=fsdp cannot span" in text
    assert "use sharding.mode=none" in text
    run = compose_run_config(["cluster.devices=[cuda,cpu]"])  # DDP over gloo: accepted
    check_devices(run, gpus=1)
    assert run.cluster.device_kinds() == ["cuda", "cpu"]


def test_one_gpu_and_one_cpu_rank_fit_a_one_gpu_machine_fake_gpu_count(monkeypatch):
    """The local launcher's "NCCL cannot run two ranks on one GPU" does not apply to a job
    that runs gloo on every rank."""
    monkeypatch.setattr("hetseq_hpc.config.validate.visible_gpu_count", lambda: 1)
    local.check_ranks_fit_gpus(compose_run_config(["cluster.devices=[cuda,cpu]"]), gpus=1)
    local.check_ranks_fit_gpus(compose_run_config(["cluster.devices=[cuda,cpu,cpu]"]), gpus=1)
    with pytest.raises(ConfigError, match="NCCL cannot run two ranks on one GPU"):
        local.check_ranks_fit_gpus(compose_run_config(["cluster.devices=[cuda,cuda]"]), gpus=1)


def test_mixed_kinds_pass_only_where_every_rank_runs_gloo():
    check_device_kinds(["cuda", "cpu"], gloo=True)
    check_device_kinds(["cpu", "cpu"])
    with pytest.raises(AllocationError) as err:
        check_device_kinds(["cuda", "cpu"])  # devices not named: the GPU rank joined NCCL
    text = str(err.value)
    assert "rank 0: cuda, rank 1: cpu" in text and "cluster.devices=[cuda,cpu]" in text


def test_a_mixed_gloo_job_agrees_on_ddp_and_refuses_an_fsdp_it_would_need():
    gang = FakeGang(world_size=2, rank=1, answers=[{0: ("cuda", True)}])
    assert agree_on_sharding("auto", 1 * GiB, 100 * GiB, gang, "cpu", gloo=True) == "ddp"
    gang = FakeGang(world_size=2, rank=1, answers=[{0: ("cuda", True)}])
    with pytest.raises(AllocationError) as err:  # rank 1's budget cannot hold a replica
        agree_on_sharding("auto", 1 * GiB, 1 * GiB, gang, "cpu", gloo=True)
    text = str(err.value)
    assert "a full replica does not fit rank(s) [1]" in text and "cuda, cpu" in text


def _world(rank: int) -> WorldInfo:
    return WorldInfo(
        rank=rank, local_rank=rank, world_size=2, master_addr="127.0.0.1", master_port=29500
    )


def test_each_rank_takes_the_device_the_config_names_no_cuda_here():
    assert pick_device(_world(0), ["cpu", "cpu"]) == CPU
    assert pick_device(_world(1), ["cuda", "cpu"]) == CPU
    assert pick_device(_world(0), None) == CPU  # no CUDA: today's rule
    with pytest.raises(ConfigError, match="puts rank 0 on cuda but torch sees no CUDA GPU"):
        pick_device(_world(0), ["cuda", "cpu"])
