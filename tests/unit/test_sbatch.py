"""cluster=testcluster without Slurm: the het-job script is pinned by a golden file, values that
would break out of an sbatch line are refused, the watcher folds het components.
(tests/integration/test_slurm_cli.py: the command line without a cluster;
tests/slurm/test_slurm.py: against the real Slurm test cluster.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.launch.slurm import HetSlurmInfoWatcher
from hetseq_hpc.rundir.paths import RunDir
from tests.helpers.slurm import compose_testcluster

GOLDEN = Path(__file__).parent.parent / "golden" / "testcluster.sbatch"


# ------------------------------------------------------------------ no Slurm needed
def test_sbatch_text_matches_golden_file():
    """The rendered het-job script is pinned (regenerate: HETSEQ_REGEN_GOLDEN=1)."""
    run = compose_testcluster()
    text = render_sbatch(run.cluster, "/RUN/submitit", "/PYTHON")
    if os.environ.get("HETSEQ_REGEN_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    assert text.count("#SBATCH hetjob") == 1
    assert "--het-group=0-1" in text and "--gres=gpu:v100:1" in text


def test_elastic_script_serves_the_store_and_its_step_survives_a_task():
    """``trainer.elastic`` (a DDP run): the store is served on the batch host before ``srun``
    with a fresh token, ended on exit, and the step neither ends on a task's bad exit nor on a
    lost node; without it, the golden script (one task's failure ends the step)."""
    run = compose_testcluster()
    text = render_sbatch(run.cluster, "/RUN/submitit", "/PYTHON", elastic=True)
    lines = text.splitlines()
    srun = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    store = next(i for i, ln in enumerate(lines) if "hetseq_hpc.distributed.store_server" in ln)
    assert store < srun and lines[store].endswith("&")
    assert "--kill-on-bad-exit=0 --no-kill" in lines[srun]
    assert "export HETSEQ_JOB_TOKEN" in text and "trap 'kill $store_pid" in text
    assert "--host auto --nodes 3 " in lines[store] and "$(hostname)" not in text
    assert 'export HETSEQ_STORE="$(cat ' in text and "did not start" in text
    assert "HETSEQ_JOB_TOKEN" not in lines[store]  # the token travels in the environment
    plain = render_sbatch(run.cluster, "/RUN/submitit", "/PYTHON")
    assert "--kill-on-bad-exit=1" in plain and "store_server" not in plain
    # with the run directory: srun's failure for a lost task is not the job's when the
    # survivors wrote the run's summary in this job (Slurm: COMPLETED, afterok holds)
    ended = render_sbatch(
        run.cluster, "/RUN/submitit", "/PYTHON", elastic=True, run_dir=RunDir("/RUN")
    ).splitlines()
    at = next(i for i, ln in enumerate(ended) if ln.startswith("srun "))
    assert ended[at - 2] == "summary=/RUN/summary.json" and ended[at].endswith(" &")
    assert ended[at - 1] == "started=$(date +%s)"
    rest = ended[at:]
    # a task stopped or hung after the others finished: the script ends the step itself
    assert "grace=${HETSEQ_END_GRACE_S:-20}" in rest and 'wait "$srun_pid" || status=$?' in rest
    assert '    kill -INT "$srun_pid"; sleep 0.3; kill -INT "$srun_pid"' in rest
    assert '  [ -f "$summary" ] && [ "$(stat -c %Y "$summary")" -ge "$started" ]' in rest
    check = rest.index("if finished; then")
    assert rest[check - 1] == '[ "$status" = 0 ] && exit 0' and rest[check + 2] == "  exit 0"
    assert ended[-1] == 'exit "$status"'


def test_store_host_is_reachable_from_other_nodes_or_refused():
    """``--host auto``: the first non-loopback address of ``hostname -I`` (IPv4 first), an
    explicit HETSEQ_STORE_HOST, 127.0.0.1 for a one-node job; a loopback address for a job
    over several nodes is refused with the fix (Debian's $(hostname) is 127.0.1.1)."""
    from hetseq_hpc.distributed.store_server import store_host
    from hetseq_hpc.errors import LaunchError

    assert store_host(3, {}, ["fd00::2", "192.0.2.2", "10.0.0.5"]) == "192.0.2.2"
    assert store_host(3, {}, ["fe80::1", "fd00::2"]) == "fd00::2"
    assert store_host(3, {"HETSEQ_STORE_HOST": "10.1.1.1"}, ["192.0.2.2"]) == "10.1.1.1"
    assert store_host(1, {}, []) == "127.0.0.1"
    with pytest.raises(LaunchError, match=r"cannot reach: set HETSEQ_STORE_HOST"):
        store_host(2, {}, ["127.0.1.1"])
    with pytest.raises(LaunchError, match=r"127\.0\.1\.1"):
        store_host(2, {"HETSEQ_STORE_HOST": "127.0.1.1"}, ["192.0.2.2"])


@pytest.mark.parametrize("bad", ["a100\nq", "a100\n#SBATCH --qos=high", "`id`", "a'b"])
def test_sbatch_values_with_newlines_or_quotes_are_rejected(bad):
    from hetseq_hpc.config.schema import PartitionConfig
    from hetseq_hpc.errors import ConfigError

    with pytest.raises(ConfigError, match="not allowed in an sbatch script"):
        PartitionConfig(partition=bad).validate("a100")
    with pytest.raises(ConfigError):
        PartitionConfig(partition="a100", extra_sbatch={"exclude": bad}).validate("a100")


def test_watcher_folds_het_components():
    watcher = HetSlurmInfoWatcher()
    info = watcher.read_info(
        "12+0|RUNNING\n12+1|PENDING\n13+0|COMPLETED\n13+1|CANCELLED\n"
        "14+0|COMPLETED\n14+1|COMPLETED\n15|FAILED\n"
    )
    assert {k: v["State"] for k, v in info.items()} == {
        "12": "PENDING",
        "13": "CANCELLED",
        "14": "COMPLETED",
        "15": "FAILED",
    }
