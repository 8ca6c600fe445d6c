"""The PRIVATE parts of submitit that hetseq_hpc.launch.slurm builds het jobs on, pinned.

submitit has no het-job support (its issue #1741); :class:`HetSlurmExecutor`,
:class:`HetSlurmJob` and :class:`HetSlurmInfoWatcher` override or read private methods and
attributes. A submitit release that renames or re-signs one of them would break het jobs
silently (rank 0's result only, a job that never finishes): these tests fail first. The last
test submits through the real executor code with ``sbatch`` replaced by a recording script at
the command boundary, so the override points are checked by use, not only by name.
"""

from __future__ import annotations

import inspect
import os
import stat
import sys
from pathlib import Path

import pytest
import submitit
from submitit.core import core, submission
from submitit.core import utils as submitit_utils
from submitit.slurm import slurm as submitit_slurm

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.launch.slurm import HetseqJobFunction, HetSlurmExecutor, HetSlurmJob
from hetseq_hpc.launch.slurm_watch import HetSlurmInfoWatcher


def _params(func) -> list:
    return list(inspect.signature(func).parameters)


def test_submitit_version_is_in_the_tested_range():
    major, minor, *_ = (int(x) for x in submitit.__version__.split(".")[:3])
    assert (major, minor) == (1, 5), f"submitit {submitit.__version__}: re-run these contracts"


@pytest.mark.parametrize("name, params", [
    ("__init__", ["self", "folder", "max_num_timeout", "max_pickle_size_gb", "python"]),
    ("_make_submission_file_text", ["self", "command", "uid"]),
    ("_num_tasks", ["self"]),
    ("_make_submission_command", ["self", "submission_file_path"]),
    ("update_parameters", ["self", "kwargs"]),
])
def test_executor_override_points(name, params):
    assert _params(getattr(submitit_slurm.SlurmExecutor, name)) == params


def test_executor_uses_job_class_num_tasks_and_submission_text():
    """core.PicklingExecutor._submit_command builds the job from these three hooks."""
    assert submitit_slurm.SlurmExecutor.job_class is submitit_slurm.SlurmJob
    source = inspect.getsource(core.PicklingExecutor._submit_command)
    for hook in ("self._make_submission_file_text(command,", "self._num_tasks()",
                 "self.job_class(folder=self.folder, job_id=job_id, tasks=tasks_ids)"):
        assert hook in source, hook


@pytest.mark.parametrize("name, params", [
    ("__init__", ["self", "delay_s"]),
    ("_make_command", ["self"]),
    ("read_info", ["self", "string"]),
    ("update", ["self"]),
    ("is_done", ["self", "job_id", "mode"]),
    ("get_state", ["self", "job_id", "mode"]),
    ("register_job", ["self", "job_id"]),
])
def test_watcher_override_points(name, params):
    assert _params(getattr(submitit_slurm.SlurmInfoWatcher, name)) == params


def test_watcher_private_state_our_update_writes():
    """HetSlurmInfoWatcher.update maintains these attributes as submitit's own update does."""
    watcher = submitit_slurm.SlurmInfoWatcher(delay_s=1)
    for attr in ("_registered", "_finished", "_info_dict", "_num_calls", "_last_status_check"):
        assert hasattr(watcher, attr), attr
    assert isinstance(watcher._registered, set) and isinstance(watcher._finished, set)
    assert isinstance(watcher._info_dict, dict)
    assert "self._info_dict" in inspect.getsource(submitit_slurm.SlurmInfoWatcher.get_info)


def test_job_class_and_paths_layout():
    assert _params(submitit_slurm.SlurmJob.__init__) == ["self", "folder", "job_id", "tasks"]
    assert isinstance(HetSlurmJob.watcher, HetSlurmInfoWatcher)
    paths = submitit_utils.JobPaths("/f", job_id="12", task_id=3)
    # the names the sbatch text writes by redirection and wait_for_job reads
    assert str(paths.result_pickle) == "/f/12_3_result.pkl"
    assert str(paths.stdout) == "/f/12_3_log.out" and str(paths.stderr) == "/f/12_3_log.err"
    assert str(paths.submitted_pickle) == "/f/12_submitted.pkl"


def test_entry_point_and_result_helpers_exist():
    """The sbatch step runs ``python -m submitit.core._submit FOLDER``; results are pickles."""
    assert Path(inspect.getfile(submission)).with_name("_submit.py").is_file()
    assert _params(submission.process_job) == ["folder"]
    assert _params(submitit_utils.pickle_load) == ["filename"]
    assert issubclass(submitit_utils.FailedJobError, RuntimeError)


def test_submission_through_the_real_executor(tmp_path, monkeypatch):
    """submit() with a recording ``sbatch`` on PATH: the script submitted is ours (het
    components), the job is a HetSlurmJob over every rank, and the folder holds submitit's
    layout (submission file, submitted pickle)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path / 'submitted.sh'}\n"
                      "echo 'Submitted batch job 4242'\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = compose_run_config(["cluster=testcluster"])
    folder = tmp_path / "submitit"
    executor = HetSlurmExecutor(folder, run.cluster, python=sys.executable)
    job = executor.submit(HetseqJobFunction(str(tmp_path / "cfg.yaml"), str(tmp_path)))
    assert isinstance(job, HetSlurmJob) and job.job_id == "4242"
    assert job.num_tasks == run.cluster.world_size == 3
    script = (tmp_path / "submitted.sh").read_text()
    assert "#SBATCH hetjob" in script and "--het-group=0-1" in script
    assert (folder / "4242_submitted.pkl").is_file()
    assert (folder / "4242_submission.sh").exists()
