"""The PRIVATE parts of submitit that hetseq_hpc.launch.slurm builds het jobs on, pinned.

submitit has no het-job support (its issue #1741); :class:`HetSlurmExecutor`,
:class:`HetSlurmJob` and :class:`HetSlurmInfoWatcher` override or read private methods and
attributes. A submitit release that renames or re-signs one of them would break het jobs
silently (rank 0's result only, a job that never finishes): these tests fail first.
(Submitting through the real executor with a recording ``sbatch``:
tests/integration/test_submitit_submission.py.)
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import submitit
from submitit.core import core, submission
from submitit.core import utils as submitit_utils
from submitit.slurm import slurm as submitit_slurm

from hetseq_hpc.launch.slurm import HetSlurmJob
from hetseq_hpc.launch.slurm_watch import HetSlurmInfoWatcher


def _params(func) -> list:
    return list(inspect.signature(func).parameters)


def test_submitit_version_is_in_the_tested_range():
    major, minor, *_ = (int(x) for x in submitit.__version__.split(".")[:3])
    assert (major, minor) == (1, 5), f"submitit {submitit.__version__}: re-run these contracts"


@pytest.mark.parametrize(
    "name, params",
    [
        ("__init__", ["self", "folder", "max_num_timeout", "max_pickle_size_gb", "python"]),
        ("_make_submission_file_text", ["self", "command", "uid"]),
        ("_num_tasks", ["self"]),
        ("_make_submission_command", ["self", "submission_file_path"]),
        ("update_parameters", ["self", "kwargs"]),
    ],
)
def test_executor_override_points(name, params):
    assert _params(getattr(submitit_slurm.SlurmExecutor, name)) == params


def test_executor_uses_job_class_num_tasks_and_submission_text():
    """core.PicklingExecutor._submit_command builds the job from these three hooks."""
    assert submitit_slurm.SlurmExecutor.job_class is submitit_slurm.SlurmJob
    source = inspect.getsource(core.PicklingExecutor._submit_command)
    for hook in (
        "self._make_submission_file_text(command,",
        "self._num_tasks()",
        "self.job_class(folder=self.folder, job_id=job_id, tasks=tasks_ids)",
    ):
        assert hook in source, hook


@pytest.mark.parametrize(
    "name, params",
    [
        ("__init__", ["self", "delay_s"]),
        ("_make_command", ["self"]),
        ("read_info", ["self", "string"]),
        ("update", ["self"]),
        ("is_done", ["self", "job_id", "mode"]),
        ("get_state", ["self", "job_id", "mode"]),
        ("register_job", ["self", "job_id"]),
    ],
)
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
    """The sbatch step runs ``python -m hetseq_hpc.launch.slurm_task FOLDER``, which does what
    submitit's own ``python -m submitit.core._submit FOLDER`` does (``process_job(folder)``,
    nothing else), then ends the process; results are pickles."""
    assert Path(inspect.getfile(submission)).with_name("_submit.py").is_file()
    assert _params(submission.process_job) == ["folder"]
    body = inspect.getsource(submission.submitit_main).split('"""')[-1]
    calls = [line.strip() for line in body.splitlines() if "(" in line]
    assert calls[-1] == "process_job(args.folder)", calls
    assert _params(submitit_utils.pickle_load) == ["filename"]
    assert issubclass(submitit_utils.FailedJobError, RuntimeError)
