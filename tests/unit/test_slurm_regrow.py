"""Grow back on Slurm (issue 45) without Slurm: the supervisor's layout of the job's slots, where
a replacement goes (the lost rank's node, else a spare one), its step and environment, and
which lost members it replaces, over torch's in-process store. The steps it starts are recorded,
not started (tests/slurm/test_elastic_slurm.py runs them on the real test cluster)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hetseq_hpc.distributed.admission import answer_key, closed_key, refused_key
from hetseq_hpc.env.world import HET_NTASKS_ENV, WorldError, WorldInfo
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.launch.sbatch import render_sbatch
from hetseq_hpc.launch.slurm_checks import check_partitions, parse_inventory
from hetseq_hpc.launch.slurm_regrow import (
    Supervisor,
    choose_node,
    node_usable,
    replacement_command,
    replacement_env,
    slot_layout,
)
from hetseq_hpc.rundir.paths import RunDir
from tests.helpers.slurm import compose_testcluster
from tests.unit.test_slurm_unit import SINFO_TESTCLUSTER

#: the batch script's environment of the test cluster's job with one spare node per component
BATCH_ENV = {
    "SLURM_JOB_ID": "41",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n[3-4]",
    "HETSEQ_STORE": "10.0.0.1:5000",
}


def _spare_run(restarts: int = 1):
    return compose_testcluster(
        "cluster.partitions.v100.nodes=1",
        f"trainer.elastic.restarts={restarts}",
        "trainer.elastic.spare_nodes=1",
    )


def test_slots_follow_the_components_and_keep_the_spares_apart():
    slots = slot_layout(_spare_run().cluster, BATCH_ENV, spare_nodes=1)
    assert [(s.rank, s.component, s.partition, s.node) for s in slots] == [
        (0, 0, "a100", "n1"),
        (1, 1, "v100", "n3"),
    ]
    assert [tuple(s.spare) for s in slots] == [("n2",), ("n4",)]
    with pytest.raises(ValueError, match="needs 1 \\+ 2 spare"):
        slot_layout(_spare_run().cluster, BATCH_ENV, spare_nodes=2)


def test_two_ranks_per_node_share_it_in_block_order():
    run = compose_testcluster("cluster.partitions.v100.gpus_per_node=2")
    slots = slot_layout(run.cluster, BATCH_ENV)
    assert [(s.rank, s.node, s.local_rank) for s in slots] == [
        (0, "n1", 0),
        (1, "n3", 0),
        (2, "n3", 1),
        (3, "n4", 0),
        (4, "n4", 1),
    ]


@pytest.mark.parametrize(
    ("state", "usable"),
    [
        ("IDLE", True),
        ("MIXED", True),
        ("ALLOCATED", True),
        ("MIXED+DRAIN", False),
        ("DRAINED", False),
        ("DOWN*", False),
        ("IDLE*", False),
        ("MIXED+NOT_RESPONDING", False),
        ("", False),
    ],
)
def test_node_usable(state, usable):
    assert node_usable(state) is usable


def test_a_replacement_goes_to_its_node_else_to_a_usable_spare():
    slot = slot_layout(_spare_run().cluster, BATCH_ENV, spare_nodes=1)[1]
    states = {"n3": "MIXED", "n4": "IDLE"}
    assert choose_node(slot, "n3", states.get) == "n3"
    states["n3"] = "MIXED+DRAIN"
    assert choose_node(slot, "n3", states.get) == "n4"
    states["n4"] = "DOWN*"
    assert choose_node(slot, "n3", states.get) is None


def test_the_replacement_finds_its_rank_and_component_in_its_environment():
    """The new step's own ``SLURM_PROCID`` is 0 of 1: the torch variables place it."""
    slot = slot_layout(_spare_run().cluster, BATCH_ENV, spare_nodes=1)[1]
    env = replacement_env(slot, 2, 2, member=2, environ=BATCH_ENV)
    env.update({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURMD_NODENAME": "n4"})
    world = WorldInfo.from_env(env)
    assert (world.rank, world.world_size, world.het_group, world.partition) == (1, 2, 1, "v100")
    assert (world.master_addr, world.master_port, world.node_name) == ("n1", 15041, "n4")
    assert env["HETSEQ_MEMBER"] == "2" and env["HETSEQ_JOIN"] == "1"
    assert env["HETSEQ_STORE"] == "10.0.0.1:5000"  # the job's store, from the batch script
    cmd = replacement_command(slot, "n4", 2, "/PY", "/RUN/submitit", "41")
    assert cmd[:8] == [
        "srun",
        "--unbuffered",
        "--het-group=1",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n4",
        "--kill-on-bad-exit=0",
    ]
    # submitit's entry point under the lost rank's number and the job's id: its result file
    assert cmd[-4:] == ["/PY", "/RUN/submitit", "1", "41"]
    assert cmd[-5].startswith('export SLURM_PROCID="$2" SLURM_JOB_ID="$3"; exec "$0"')


def test_the_step_of_a_job_with_spares_names_its_tasks_per_component():
    """Slurm's ``SLURM_NTASKS_HET_GROUP_<k>`` count the allocation's tasks (spares too): the
    script says the step's, and the ranks read them."""
    run = _spare_run()
    text = render_sbatch(run.cluster, "/RUN/submitit", "/PY", True, RunDir("/RUN"), 1, 1)
    assert text.count("#SBATCH --nodes=2") == 2 and "+ 1 spare node(s)" in text
    assert f"export {HET_NTASKS_ENV}=1,1" in text
    step = next(ln for ln in text.splitlines() if "hetseq_hpc.launch.slurm_regrow" in ln)
    assert step.startswith("/PY -m hetseq_hpc.launch.slurm_regrow --config /RUN/")
    assert " -- srun --unbuffered --het-group=0 --nodes=1 --ntasks=1 " in step
    assert " : --unbuffered --het-group=1 --nodes=1 --ntasks=1 " in step and step.endswith("&")
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "41",
        "SLURM_HET_SIZE": "2",
        "SLURM_NTASKS_HET_GROUP_0": "2",  # measured: the allocation's, spares included
        "SLURM_NTASKS_HET_GROUP_1": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]",
        "SLURM_JOB_PARTITION_HET_GROUP_1": "v100",
    }
    with pytest.raises(WorldError, match="add up to 4"):
        WorldInfo.from_env(env)
    world = WorldInfo.from_env({**env, HET_NTASKS_ENV: "1,1"})
    assert (world.rank, world.het_group, world.partition) == (1, 1, "v100")
    with pytest.raises(WorldError, match="names 1 component"):
        WorldInfo.from_env({**env, HET_NTASKS_ENV: "2"})
    # without spares the step covers the allocation: no counts, one --het-group=0-1
    plain = render_sbatch(run.cluster, "/RUN/submitit", "/PY", True, RunDir("/RUN"), 1, 0)
    assert HET_NTASKS_ENV not in plain and "--het-group=0-1" in plain


class _Step:
    """A started step as the supervisor sees it (``poll``, ``returncode``); ends when told."""

    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode


@pytest.fixture
def supervised(tmp_path):
    run = _spare_run(restarts=1)
    store = dist.HashStore()
    started = []

    def start(slot, node, member):
        started.append((slot.rank, node, member))
        return _Step()

    states = {"n1": "MIXED", "n2": "IDLE", "n3": "MIXED", "n4": "IDLE"}
    slots = slot_layout(run.cluster, BATCH_ENV, spare_nodes=1)
    sup = Supervisor(run, RunDir(tmp_path), store, slots, start, states.get)
    return sup, store, started, states


def test_a_member_the_others_left_out_is_replaced_once_on_its_node(supervised):
    sup, store, started, _ = supervised
    main = _Step()
    store.set("armed/1", "n3")
    assert not sup.poll(main) and started == []
    store.set("excluded/1", "0")
    sup.poll(main)
    sup.poll(main)
    assert started == [(1, "n3", 2)] and sup.member_of == [0, 2]
    # the replacement lost too: rank 1 has no restarts left (trainer.elastic.restarts=1)
    store.set(answer_key(2), '{"generation": 2}')
    store.set("excluded/2", "1")
    sup.poll(main)
    assert started == [(1, "n3", 2)]


def test_a_drained_node_sends_the_replacement_to_a_spare(supervised):
    sup, store, started, states = supervised
    states["n3"] = "MIXED+DRAIN"
    store.set("armed/1", "n3")
    store.set("excluded/1", "0")
    sup.poll(_Step())
    assert started == [(1, "n4", 2)]


def test_refused_and_finished_runs_get_no_replacement(supervised, tmp_path):
    sup, store, started, _ = supervised
    store.set(refused_key(1), "1")
    store.set("excluded/1", "0")
    sup.poll(_Step())
    assert started == []
    (tmp_path / "summary.json").write_text("{}")
    store.set("excluded/0", "0")
    sup.poll(_Step())
    assert started == []


def test_a_replacement_lost_before_admission_is_started_again(tmp_path):
    run = _spare_run(restarts=2)
    store = dist.HashStore()
    steps = []

    def start(slot, node, member):
        steps.append((slot.rank, member, _Step()))
        return steps[-1][2]

    slots = slot_layout(run.cluster, BATCH_ENV, spare_nodes=1)
    sup = Supervisor(run, RunDir(tmp_path), store, slots, start, lambda n: "IDLE")
    main = _Step()
    store.set("excluded/0", "0")
    sup.poll(main)
    steps[0][2].returncode = -9  # killed while it waited for its answer
    sup.poll(main)
    assert [(r, m) for r, m, _ in steps] == [(0, 2), (0, 3)]
    # the main step ends: the one left waits for an answer nobody gives; admissions close
    main.returncode = 0
    assert not sup.poll(main) and store.check([closed_key()])
    steps[1][2].returncode = 0
    assert sup.poll(main)
    assert sup.exit_status(main) == 128 + 9  # the first failed replacement's, as a shell says


def test_spare_nodes_are_counted_before_submitting():
    """3 ranks on a100 n1 + v100 n3, n4: a spare per component needs a third v100 node."""
    cluster = compose_testcluster().cluster
    inventory = parse_inventory(SINFO_TESTCLUSTER)
    check_partitions(cluster, inventory, spare_nodes=0)
    with pytest.raises(ConfigError) as info:
        check_partitions(cluster, inventory, spare_nodes=1)
    line = str(info.value)
    assert "cluster.partitions.v100.nodes=2 + trainer.elastic.spare_nodes=1" in line
    assert "has 2 node(s)" in line and "\n" not in line
    check_partitions(_spare_run().cluster, inventory, spare_nodes=1)
