"""``cluster.command``: every rank runs the user's own script (a Lightning / Fabric /
accelerate script using hetseq_hpc.integrations) under the same launchers. In-process: the key
is validated in one line, the Slurm job runs the command's job function instead of the worker,
without in-job recovery, and the sbatch script is the one the worker gets."""

from __future__ import annotations

import pytest

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.launch.command import CommandJobFunction
from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.launch.slurm import HetseqJobFunction, elastic_job, job_function

SCRIPT = ["cluster.command=[python,train.py,--max-steps,5]"]


def test_the_command_is_a_list_of_words_on_every_cluster():
    run = compose_run_config(["cluster=testcluster", *SCRIPT])
    assert list(run.cluster.command) == ["python", "train.py", "--max-steps", "5"]
    local = compose_run_config(["cluster=local", *SCRIPT])
    assert list(local.cluster.command) == ["python", "train.py", "--max-steps", "5"]
    assert list(compose_run_config(["cluster=local"]).cluster.command) == []


def test_an_empty_word_is_refused_in_one_line():
    with pytest.raises(
        ConfigError,
        match=r"cluster\.command\[1\]='' is invalid: .*cluster\.command=\[python,train\.py\]",
    ):
        compose_run_config(["cluster=local", "cluster.command=[python,'']"])


def test_a_slurm_job_runs_the_command_without_in_job_recovery_and_the_same_script(tmp_path):
    plain = compose_run_config(["cluster=testcluster"])
    script = compose_run_config(["cluster=testcluster", *SCRIPT])
    assert elastic_job(plain) and not elastic_job(script)
    function = job_function(script, "cfg.yaml", str(tmp_path))
    assert isinstance(function, CommandJobFunction)
    assert function.command == ["python", "train.py", "--max-steps", "5"]
    assert isinstance(job_function(plain, "cfg.yaml", str(tmp_path)), HetseqJobFunction)
    same = render_sbatch(plain.cluster, "/f", "/py", False, str(tmp_path))
    assert render_sbatch(script.cluster, "/f", "/py", False, str(tmp_path)) == same
