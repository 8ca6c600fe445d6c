"""A het job whose nodes each have their own address (issue 46): the test cluster of
scripts/test-cluster.sh in network-namespace mode (every node's slurmd in its own namespace on
a bridge), started here in a state directory of its own and stopped after. Rank discovery,
the rendezvous, gloo's sockets and the job's store must each use the right node's address:
on one host address (the ordinary test cluster) a wrong choice still connects."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, SMALL_MODEL, assert_ok, assert_same_losses, hetseq, losses
from tests.helpers.slurm import netns_cluster, node_links, reachable, slurm_cli
from tests.helpers.waits import wait_for

JOB = [
    "task.model.max_seq_len=32",
    "task.model.dropout=0.0",
    "trainer.global_batch_size=12",
    "trainer.max_steps=4",
    "optim.schedule_steps=4",
    "trainer.seed=7",
    "trainer.val_every=0",
    "trainer.checkpoint_every=0",
]
ADDRESS = re.compile(r"rank (\d) on node (\S+): address (\S+), interface (\S+) towards the master")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_het_job_over_three_node_addresses_runs_exact_against_one_rank(
    tmp_path, token_cache, monkeypatch
):
    """3 ranks on 3 namespaced nodes (a100 x 1 + v100 x 2): the losses of a 1-rank run, each
    rank logs its own node's address on its own interface, and the master is rank 0's node.
    Then the same cluster's `link` cuts and restores a node, and its stop leaves nothing."""
    ref = tmp_path / "ref"
    done = hetseq(
        *SMALL_MODEL, *JOB, "cluster.ranks=1", f"hydra.run.dir={ref}", token_cache=token_cache
    )
    assert_ok(done)
    with netns_cluster() as slurm_conf:
        monkeypatch.setenv("SLURM_CONF", slurm_conf)
        run_dir = tmp_path / "job"
        proc = slurm_cli(run_dir, token_cache, "cluster.wait=true", *JOB, timeout=300)
        assert_ok(proc)
        # a partition drill's tool: `link n3 down` cuts that node off, `up` brings it back
        cluster = [str(REPO / "scripts" / "test-cluster.sh"), "link", "n3"]
        env = {**os.environ, "HETSEQ_TESTCLUSTER_DIR": str(Path(slurm_conf).parent.parent)}
        (addr, port) = next(v for k, v in node_links(slurm_conf).items() if k.endswith("n3"))
        assert reachable(addr, port)
        assert subprocess.run([*cluster, "down"], env=env).returncode == 0
        assert not reachable(addr, port)
        assert subprocess.run([*cluster, "up"], env=env).returncode == 0
        wait_for(lambda: reachable(addr, port), f"n3's slurmd at {addr}:{port} after link up")
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    assert_same_losses(got, losses(ref), range(1, 5))

    seen = {}
    for rank in range(3):
        (line,) = ADDRESS.findall((run_dir / "logs" / f"rank{rank}.log").read_text())
        seen[rank] = line
    nodes = [seen[r][1] for r in range(3)]
    addresses = [seen[r][2] for r in range(3)]
    assert len(set(addresses)) == 3, seen
    assert all(a.startswith("10.231.") and not a.startswith("127.") for a in addresses), seen
    assert all(seen[r][3] != "lo" for r in range(3)), seen  # gloo off the loopback
    alloc = json.loads((run_dir / "allocation.json").read_text())
    assert [r["node"] for r in alloc["ranks"]] == nodes
    assert {r["world"]["master_addr"] for r in alloc["ranks"]} == {nodes[0]}
    # the job's store, served by the batch script on rank 0's node, on that node's address
    job = json.loads((run_dir / "job.json").read_text())["job_id"]
    store = (run_dir / "submitit" / f"{job}_store.address").read_text().strip()
    assert store.rsplit(":", 1)[0] == addresses[0], (store, seen)
    # rank 0's route to the master is local: the master is its own node's address
    assert all(
        f"({addresses[0]})" in (run_dir / "logs" / f"rank{r}.log").read_text() for r in range(3)
    )


@pytest.mark.slurm
def test_without_net_admin_the_start_exits_3_with_one_line_and_leaves_nothing(tmp_path):
    """Where namespaces are not allowed (here: CAP_NET_ADMIN dropped with setpriv), the start
    says so in one line with exit 3, the code tests skip on, and leaves no daemon or link."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    state = tmp_path / "c"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSEQ_TESTCLUSTER")}
    env.update(HETSEQ_TESTCLUSTER_DIR=str(state), HETSEQ_TESTCLUSTER_NETNS="1")
    drop = ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin"]
    script = str(REPO / "scripts" / "test-cluster.sh")
    start = subprocess.run([*drop, script, "start"], env=env, capture_output=True, text=True)
    assert start.returncode == 3, start.stderr
    assert "network namespaces are not allowed here" in start.stderr.splitlines()[-1]
    assert start.stdout == ""
    assert not list((state / "run" / "ours").glob("*")), "nothing of ours left running"
    assert (
        str(state)
        not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    )
