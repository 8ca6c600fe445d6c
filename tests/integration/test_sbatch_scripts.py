"""The rendered sbatch script run for real: valid bash for any run directory, and its job-store
server (moved from tests/unit/test_sbatch.py: they start processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.rundir.paths import RunDir
from tests.helpers.runs import hetseq, start_hetseq
from tests.helpers.slurm import compose_testcluster
from tests.helpers.waits import wait_for


def test_elastic_script_is_valid_bash_for_any_run_directory(tmp_path):
    """``bash -n`` on the elastic script and the hand templates: a run directory with spaces and
    both kinds of quotes is quoted once, in a variable, never inside another string (it was
    inside an ``echo "..."``: a syntax error that ended the job before its step ran)."""
    import subprocess

    run = compose_testcluster()
    odd = '/runs/my run\'s "dir" $HOME `x`'
    script = tmp_path / "job.sbatch"
    script.write_text(
        render_sbatch(run.cluster, f"{odd}/submitit", "/PYTHON", elastic=True, run_dir=RunDir(odd))
    )
    assert "summary='/runs/my run'\"'\"'s \"dir\" $HOME `x`/summary.json'" in script.read_text()
    repo = Path(__file__).resolve().parents[2]
    for path in (script, repo / "slurm" / "hetjob.sbatch", repo / "slurm" / "single.sbatch"):
        checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, (path, checked.stderr)


def test_store_server_listens_on_its_address_only_and_takes_the_token_from_the_env(tmp_path):
    """The batch script's store server binds the one address it picks, not every interface
    (torch's TCPStore alone would), writes ``host:port``, and serves only the token holder;
    the token is nowhere on its command line nor in its output, and it loads no torch."""
    import signal
    from multiprocessing import AuthenticationError

    from hetseq_hpc.distributed.auth_store import AuthStoreClient

    token = "9" * 32
    where = tmp_path / "store.address"
    env = {**os.environ, "HETSEQ_JOB_TOKEN": token, "HETSEQ_STORE_HOST": "127.0.0.1"}
    proc = start_hetseq(
        "--host",
        "auto",
        "--nodes",
        "1",
        "--address-file",
        str(where),
        module="hetseq_hpc.distributed.store_server",
        env=env,
        stdout=None,
    )
    try:
        wait_for(
            lambda: where.exists() and where.read_text().strip(),
            f"the store server's address in {where}",
            60,
            proc=proc,
            poll_s=0.05,
        )
        host, port = where.read_text().strip().rsplit(":", 1)
        port = int(port)
        assert host == "127.0.0.1"
        listening = [
            ln.split()[1]
            for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]
            if ln.split()[3] == "0A"
        ]  # LISTEN
        ours = [a for a in listening if int(a.split(":")[1], 16) == port]
        assert ours == ["0100007F:" + f"{port:04X}"], ours  # 127.0.0.1 only
        assert token not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        # it serves without torch (~3 CPU-s of every elastic job's batch host): no libtorch
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        from datetime import timedelta

        AuthStoreClient(host, port, token, timedelta(seconds=5)).set("x", "1")
        with pytest.raises(AuthenticationError):
            AuthStoreClient(host, port, "0" * 32, timedelta(seconds=5))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and token not in err, err
    proc = hetseq(
        "--host",
        "127.0.0.1",
        "--address-file",
        str(where),
        module="hetseq_hpc.distributed.store_server",
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "HETSEQ_JOB_TOKEN"},
    )
    assert proc.returncode == 2 and "HETSEQ_JOB_TOKEN" in proc.stderr.strip().splitlines()[-1]
