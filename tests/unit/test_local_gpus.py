"""The local launcher and the GPUs it sees: more ranks than GPUs is refused before anything starts.

Found on a lent H100 (docs/benchmarks.md, 2026-11-27): ``cluster.ranks=2`` on one GPU started both
ranks, which failed at the rendezvous with NCCL's "invalid usage" and an error that blamed the
address and port. The GPU count is faked here (no GPU on this machine); the NCCL refusal itself
was seen on the GPU.
"""

from __future__ import annotations

import pytest

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.launch import local
from hetseq_hpc.rundir.paths import RunDir


def test_more_ranks_than_gpus_is_one_line_with_the_fixes_fake_gpu_count():
    run = compose_run_config(["cluster.ranks=2"])
    with pytest.raises(ConfigError) as err:
        local.check_ranks_fit_gpus(run, gpus=1)
    text = str(err.value)
    assert "\n" not in text and "cluster.ranks=2" in text and "1 visible GPU" in text
    assert "cluster.ranks=1" in text and "CUDA_VISIBLE_DEVICES" in text


@pytest.mark.parametrize(
    "overrides, gpus",
    [(["cluster.ranks=2"], 0), (["cluster.ranks=2"], 2), (["cluster.ranks=1"], 1), ([], 4)],
)
def test_ranks_within_the_gpus_or_no_gpu_at_all_pass_fake_gpu_count(overrides, gpus, monkeypatch):
    monkeypatch.setattr("hetseq_hpc.config.cluster.visible_gpu_count", lambda: gpus)
    local.check_ranks_fit_gpus(compose_run_config(overrides), gpus=gpus)


def test_launch_refuses_before_the_run_directory_is_touched_fake_gpu_count(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "visible_gpu_count", lambda: 1)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="NCCL cannot run two ranks on one GPU"):
        local.launch_local(compose_run_config(["cluster.ranks=3"]), RunDir(run_dir))
    assert not run_dir.exists()
