"""In-job recovery on GPUs: NCCL's watchdog must not end the survivors of a lost rank. No GPU
exists on the machine these unit tests run on, so the env is checked where the rendezvous sets
it (the process group creation is replaced); the NCCL behaviour itself needs a GPU run."""

from __future__ import annotations

import os

import torch

from hetseq_hpc.distributed import rendezvous
from hetseq_hpc.distributed.rendezvous import ELASTIC_NCCL_ENV, set_elastic_nccl_env
from hetseq_hpc.env.world import WorldInfo

NAME = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def test_elastic_nccl_env_is_clean_up_only_without_gpu(caplog):
    assert ELASTIC_NCCL_ENV == {NAME: "2"}  # CleanUpOnly: abort the communicator, keep the process
    env = {}
    assert set_elastic_nccl_env(env) == {NAME: "2"} and env == {NAME: "2"}
    assert set_elastic_nccl_env(env) == {}  # already set: nothing changes, no warning
    env = {NAME: "3"}  # torch's default, SkipCleanUp, ends the process
    assert set_elastic_nccl_env(env) == {NAME: "2"} and env[NAME] == "2"
    assert any("would end this rank" in r.getMessage() for r in caplog.records)


def _join_env(monkeypatch, job):
    seen = {}

    def fake_init(**kwargs):
        seen["env"] = os.environ.get(NAME)
        seen["kwargs"] = kwargs

    monkeypatch.setattr(rendezvous.dist, "init_process_group", fake_init)
    monkeypatch.setattr(rendezvous.dist, "new_group", lambda **kwargs: "cpu-group")
    monkeypatch.setattr(rendezvous.dist, "PrefixStore", lambda prefix, store: ("prefix", store))
    world = WorldInfo(rank=0, local_rank=0, world_size=2, master_addr="10.0.0.1", master_port=29500)
    rendezvous.join(world, torch.device("cuda", 0), 30, job=job)
    return seen


def test_elastic_join_on_cuda_sets_the_nccl_env_before_the_group_without_gpu(monkeypatch):
    monkeypatch.setenv(NAME, "3")  # restored after the test
    seen = _join_env(monkeypatch, job=object())
    assert seen["env"] == "2" and seen["kwargs"]["backend"] == "cpu:gloo,cuda:nccl"


def test_non_elastic_join_on_cuda_leaves_the_nccl_env_without_gpu(monkeypatch):
    monkeypatch.setenv(NAME, "3")
    seen = _join_env(monkeypatch, job=None)
    assert seen["env"] == "3"
