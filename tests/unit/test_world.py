"""WorldInfo.from_env and expand_hostlist, driven by tables of environments.

The het-job environments are the ones measured on a real Slurm 22.05 (see
/work/shared/slurm-facts.md, "The environment a het-job task sees"): nothing here talks to a
scheduler or opens a connection.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest

from hetseq_hpc.env.hostlist import expand_hostlist
from hetseq_hpc.env.world import SLURM_PORT_BASE, WorldInfo
from hetseq_hpc.errors import WorldError

# --------------------------------------------------------------------------- environments
JOB_ID = "12"  # squeue shows 12+0, 12+1; every task sees the leader id
JOB_PORT = 15000 + 12 % 20000  # 15012


def _task_env(rank: int, node: str, nodeid: int, groups: list, job_partition: str) -> dict:
    """A 3-task het-job task environment; ``groups`` = [(nodelist, ntasks, partition), ...]
    in component order (the merged SLURM_JOB_NODELIST is always n[1,3-4])."""
    env = {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "3",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(nodeid),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_STEP_ID": "0",  # every srun step has one; the batch script has none
        "SLURM_HET_SIZE": str(len(groups)),
        "SLURM_JOB_NODELIST": "n[1,3-4]",
        # unreliable in a multi-group step: measured both v100 and a100 on rank 0
        "SLURM_JOB_PARTITION": job_partition,
        "SLURMD_NODENAME": node,
    }
    for k, (nodelist, ntasks, partition) in enumerate(groups):
        env[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"] = nodelist
        env[f"SLURM_NTASKS_HET_GROUP_{k}"] = str(ntasks)
        env[f"SLURM_JOB_PARTITION_HET_GROUP_{k}"] = partition
    return env


def het_env(rank: int, node: str, nodeid: int, job_partition: str) -> dict:
    """Task environment of the measured het job: component 0 = a100 n1 x 1 task,
    component 1 = v100 n[3-4] x 1 task per node; step ``srun --het-group=0,1``."""
    return _task_env(rank, node, nodeid, [("n1", 1, "a100"), ("n[3-4]", 2, "v100")], job_partition)


def inverse_het_env(rank: int, node: str, nodeid: int) -> dict:
    """The inverse job: component 0 = v100 n[3-4] x 1 task per node, component 1 = a100 n1.
    The merged list is sorted by name (n[1,3-4]) but rank 0 runs on n3."""
    return _task_env(rank, node, nodeid, [("n[3-4]", 2, "v100"), ("n1", 1, "a100")], "a100")


def plain_slurm_env(rank: int, local: int, node: str, nodeid: int) -> dict:
    """A plain (non-het) job, 2 nodes x 2 tasks."""
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(nodeid),
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_CPUS_PER_TASK": "8",
        "SLURMD_NODENAME": node,
    }


TORCH_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29500",
}


# --------------------------------------------------------------------------- single / torch
def test_empty_env_is_a_single_process():
    world = WorldInfo.from_env({})
    assert (world.rank, world.local_rank, world.world_size) == (0, 0, 1)
    assert world.source == "single"
    assert world.master_addr == "127.0.0.1"
    assert 1 <= world.master_port <= 65535
    assert world.node_name == socket.gethostname()
    assert world.het_group is None and world.het_size == 1
    assert world.job_id is None
    assert world.is_master


def test_single_process_honours_master_port_and_addr():
    world = WorldInfo.from_env({"MASTER_PORT": "29411", "MASTER_ADDR": "localhost"})
    assert world.source == "single"
    assert (world.master_addr, world.master_port) == ("localhost", 29411)


@pytest.mark.parametrize(
    "env, expected",
    [
        pytest.param(
            TORCH_ENV,
            dict(
                rank=1,
                local_rank=1,
                world_size=4,
                master_addr="10.0.0.5",
                master_port=29500,
                source="torch",
                job_id=None,
            ),
            id="torchrun",
        ),
        pytest.param(
            {k: v for k, v in TORCH_ENV.items() if k != "LOCAL_RANK"},
            dict(
                rank=1,
                local_rank=0,
                world_size=4,
                master_addr="10.0.0.5",
                master_port=29500,
                source="torch",
            ),
            id="torchrun-no-local-rank",
        ),
        pytest.param(
            {**plain_slurm_env(3, 1, "gpu08", 1), **TORCH_ENV},
            dict(
                rank=1,
                local_rank=1,
                world_size=4,
                master_addr="10.0.0.5",
                master_port=29500,
                source="torch",
                job_id="4242",
                node_name="gpu08",
            ),
            id="torch-wins-over-slurm",
        ),
        pytest.param(
            {**het_env(2, "n4", 2, "v100"), **TORCH_ENV, "MASTER_ADDR": "n3"},
            dict(
                rank=1, world_size=4, master_addr="n3", source="torch", het_group=None, het_size=1
            ),
            id="torch-wins-over-het-slurm",
        ),
        pytest.param(
            {
                **TORCH_ENV,
                "HETSEQ_HET_GROUP": "1",
                "HETSEQ_HET_SIZE": "2",
                "HETSEQ_PARTITION": "v100",
            },
            dict(rank=1, het_group=1, het_size=2, partition="v100", source="torch"),
            id="torch-with-hetseq-het-vars",
        ),
    ],
)
def test_torch_variables(env, expected):
    world = WorldInfo.from_env(env)
    for key, value in expected.items():
        assert getattr(world, key) == value, key


# --------------------------------------------------------------------------- plain SLURM
@pytest.mark.parametrize(
    "rank, local, node, nodeid",
    [
        pytest.param(0, 0, "gpu07", 0, id="rank0-gpu07"),
        pytest.param(1, 1, "gpu07", 0, id="rank1-gpu07"),
        pytest.param(2, 0, "gpu08", 1, id="rank2-gpu08"),
        pytest.param(3, 1, "gpu08", 1, id="rank3-gpu08"),
    ],
)
def test_plain_slurm_job(rank, local, node, nodeid):
    world = WorldInfo.from_env(plain_slurm_env(rank, local, node, nodeid))
    assert world.source == "slurm"
    assert (world.rank, world.local_rank, world.world_size) == (rank, local, 4)
    assert world.master_addr == "gpu07"  # zero padding kept
    assert world.master_port == 15000 + 4242 % 20000
    assert world.node_name == node
    assert world.job_id == "4242"
    assert world.het_group is None and world.het_size == 1
    assert world.partition == "gpu"
    assert world.cpus_per_task == 8
    assert world.is_master == (rank == 0)


def test_plain_slurm_step_nodelist_wins_over_job_nodelist():
    env = plain_slurm_env(0, 0, "gpu08", 0)
    env["SLURM_STEP_NODELIST"] = "gpu08"  # the step runs on a subset of the allocation
    assert WorldInfo.from_env(env).master_addr == "gpu08"


def test_plain_slurm_without_step_nodelist_uses_job_nodelist():
    env = plain_slurm_env(0, 0, "gpu07", 0)
    del env["SLURM_STEP_NODELIST"]
    assert WorldInfo.from_env(env).master_addr == "gpu07"


# --------------------------------------------------------------------------- het SLURM
@pytest.mark.parametrize(
    "env, rank, het_group, partition, node",
    [
        # SLURM_JOB_PARTITION is deliberately wrong for rank 0 (measured: v100 was seen)
        pytest.param(het_env(0, "n1", 0, "v100"), 0, 0, "a100", "n1", id="het-rank0-a100-n1"),
        pytest.param(het_env(1, "n3", 1, "a100"), 1, 1, "v100", "n3", id="het-rank1-v100-n3"),
        pytest.param(het_env(2, "n4", 2, "a100"), 2, 1, "v100", "n4", id="het-rank2-v100-n4"),
    ],
)
def test_het_job_measured_environment(env, rank, het_group, partition, node):
    world = WorldInfo.from_env(env)
    assert world.source == "slurm"
    assert world.rank == rank
    assert world.local_rank == 0
    assert world.world_size == 3
    assert world.het_size == 2
    assert world.het_group == het_group
    assert world.partition == partition
    assert world.node_name == node
    assert world.job_id == JOB_ID
    assert world.master_addr == "n1"
    assert world.master_port == JOB_PORT


@pytest.mark.parametrize(
    "env, rank, het_group, partition",
    [
        pytest.param(inverse_het_env(0, "n3", 0), 0, 0, "v100", id="inverse-rank0-n3"),
        pytest.param(inverse_het_env(1, "n4", 1), 1, 0, "v100", id="inverse-rank1-n4"),
        pytest.param(inverse_het_env(2, "n1", 2), 2, 1, "a100", id="inverse-rank2-n1"),
    ],
)
def test_het_job_master_is_first_node_of_component_0(env, rank, het_group, partition):
    world = WorldInfo.from_env(env)
    # the merged, name-sorted SLURM_JOB_NODELIST starts at n1, but rank 0 runs on n3
    assert expand_hostlist(env["SLURM_JOB_NODELIST"])[0] == "n1"
    assert world.master_addr == "n3"
    assert world.master_addr != "n1"
    assert (world.rank, world.world_size) == (rank, 3)
    assert world.het_group == het_group
    assert world.partition == partition


def test_het_master_equals_rank0_node():
    """Whatever the component layout, the master is the node rank 0 runs on."""
    for envs in (
        [het_env(0, "n1", 0, "a100"), het_env(1, "n3", 1, "v100"), het_env(2, "n4", 2, "v100")],
        [inverse_het_env(0, "n3", 0), inverse_het_env(1, "n4", 1), inverse_het_env(2, "n1", 2)],
    ):
        worlds = [WorldInfo.from_env(e) for e in envs]
        rank0_node = next(w.node_name for w in worlds if w.rank == 0)
        assert {w.master_addr for w in worlds} == {rank0_node}
        assert {w.master_port for w in worlds} == {JOB_PORT}


def test_het_job_ignores_merged_step_nodelist():
    # not in the measured table; a merged step list must not change the master either
    env = {**inverse_het_env(1, "n4", 1), "SLURM_STEP_NODELIST": "n[1,3-4]"}
    assert WorldInfo.from_env(env).master_addr == "n3"


# --------------------------------------------------------------------------- port / master
@pytest.mark.parametrize(
    "job_id, port",
    [
        pytest.param("12", 15012, id="small-id"),
        pytest.param("4242", 19242, id="4242"),
        pytest.param("20000", 15000, id="wraps-at-20000"),
        pytest.param("39999", 34999, id="top-of-range"),
        pytest.param("1234567", 15000 + 1234567 % 20000, id="large-id"),
    ],
)
def test_port_derived_from_job_id(job_id, port):
    env = {**het_env(1, "n3", 1, "v100"), "SLURM_JOB_ID": job_id}
    world = WorldInfo.from_env(env)
    assert world.master_port == port == SLURM_PORT_BASE + int(job_id) % 20000
    assert 15000 <= world.master_port < 35000


def test_master_port_overrides_derived_port():
    for env in (het_env(0, "n1", 0, "a100"), plain_slurm_env(2, 0, "gpu08", 1)):
        assert WorldInfo.from_env({**env, "MASTER_PORT": "29999"}).master_port == 29999


def test_user_master_addr_wins_in_slurm():
    for env in (
        het_env(2, "n4", 2, "v100"),
        inverse_het_env(0, "n3", 0),
        plain_slurm_env(1, 1, "gpu07", 0),
    ):
        world = WorldInfo.from_env({**env, "MASTER_ADDR": "10.1.2.3"})
        assert world.source == "slurm"
        assert world.master_addr == "10.1.2.3"


def test_user_master_addr_rescues_het_job_without_component_nodelist():
    env = het_env(1, "n3", 1, "v100")
    del env["SLURM_JOB_NODELIST_HET_GROUP_0"]
    world = WorldInfo.from_env({**env, "MASTER_ADDR": "n1"})
    assert world.master_addr == "n1"
    assert (world.het_group, world.partition) == (1, "v100")


# --------------------------------------------------------------------------- errors
def _without(env: dict, *keys: str) -> dict:
    return {k: v for k, v in env.items() if k not in keys}


@pytest.mark.parametrize(
    "env, names",
    [
        pytest.param(
            _without(TORCH_ENV, "MASTER_ADDR"), ["MASTER_ADDR"], id="rank-without-master-addr"
        ),
        pytest.param(
            _without(TORCH_ENV, "MASTER_PORT"), ["MASTER_PORT"], id="rank-without-master-port"
        ),
        pytest.param(_without(TORCH_ENV, "RANK"), ["RANK"], id="world-size-without-rank"),
        pytest.param({**TORCH_ENV, "RANK": "one"}, ["RANK"], id="non-integer-rank"),
        pytest.param({**TORCH_ENV, "WORLD_SIZE": "0"}, ["WORLD_SIZE"], id="world-size-zero"),
        pytest.param(
            {**TORCH_ENV, "MASTER_PORT": "70000"}, ["MASTER_PORT"], id="master-port-too-large"
        ),
        pytest.param(
            {**TORCH_ENV, "MASTER_PORT": "http"}, ["MASTER_PORT"], id="master-port-not-integer"
        ),
        pytest.param({**TORCH_ENV, "RANK": "4"}, ["RANK", "WORLD_SIZE"], id="rank-ge-world-size"),
        pytest.param(
            {**het_env(0, "n1", 0, "a100"), "SLURM_PROCID": "zero"},
            ["SLURM_PROCID"],
            id="non-integer-slurm-procid",
        ),
        pytest.param(
            {**plain_slurm_env(0, 0, "gpu07", 0), "SLURM_LOCALID": "x"},
            ["SLURM_LOCALID"],
            id="non-integer-slurm-localid",
        ),
        pytest.param(
            {**plain_slurm_env(0, 0, "gpu07", 0), "SLURM_PROCID": "4"},
            ["SLURM_PROCID", "SLURM_NTASKS"],
            id="slurm-procid-ge-ntasks",
        ),
        pytest.param(
            _without(plain_slurm_env(0, 0, "gpu07", 0), "SLURM_JOB_ID"),
            ["SLURM_JOB_ID", "MASTER_PORT"],
            id="slurm-no-job-id-no-port",
        ),
        pytest.param(
            _without(
                plain_slurm_env(0, 0, "gpu07", 0), "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"
            ),
            ["SLURM_JOB_NODELIST", "MASTER_ADDR"],
            id="slurm-no-nodelist",
        ),
        # batch-script view of a het job: SLURM_NTASKS is component 0's only
        pytest.param(
            {**het_env(0, "n1", 0, "a100"), "SLURM_NTASKS": "1"},
            ["SLURM_NTASKS", "SLURM_NTASKS_HET_GROUP_"],
            id="het-ntasks-mismatch",
        ),
        pytest.param(
            {**het_env(0, "n1", 0, "a100"), "SLURM_NTASKS_HET_GROUP_1": "3"},
            ["SLURM_NTASKS", "SLURM_NTASKS_HET_GROUP_"],
            id="het-groups-sum-too-big",
        ),
        pytest.param(
            _without(het_env(0, "n1", 0, "a100"), "SLURM_NTASKS_HET_GROUP_1"),
            ["SLURM_NTASKS_HET_GROUP_1"],
            id="het-missing-group-ntasks",
        ),
        pytest.param(
            _without(het_env(0, "n1", 0, "a100"), "SLURM_JOB_NODELIST_HET_GROUP_0"),
            ["SLURM_JOB_NODELIST_HET_GROUP_0"],
            id="het-missing-nodelist-group-0",
        ),
        pytest.param(
            {**het_env(0, "n1", 0, "a100"), "SLURM_HET_SIZE": "two"},
            ["SLURM_HET_SIZE"],
            id="het-size-not-integer",
        ),
    ],
)
def test_from_env_errors(env, names):
    with pytest.raises(WorldError) as info:
        WorldInfo.from_env(env)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, f"{name!r} not named in {message!r}"


@pytest.mark.parametrize("name", ["HETSEQ_HET_GROUP", "HETSEQ_HET_SIZE"])
def test_malformed_hetseq_het_variable_is_a_world_error(name):
    with pytest.raises(WorldError, match=name):
        WorldInfo.from_env({**TORCH_ENV, name: "x"})


def test_rank_ge_world_size_raises_world_error():
    for env in (
        {**TORCH_ENV, "RANK": "4"},
        {**plain_slurm_env(0, 0, "gpu07", 0), "SLURM_PROCID": "4"},
    ):
        with pytest.raises(WorldError, match="is not below"):
            WorldInfo.from_env(env)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        pytest.param(dict(world_size=0), "world size", id="world-size-0"),
        pytest.param(dict(rank=-1), "rank -1", id="negative-rank"),
        pytest.param(dict(local_rank=-1), "local rank", id="negative-local-rank"),
        pytest.param(dict(master_addr=""), "MASTER_ADDR", id="empty-master"),
        pytest.param(dict(master_port=0), "port", id="port-0"),
        pytest.param(dict(master_port=65536), "port", id="port-65536"),
        pytest.param(dict(het_group=2, het_size=2), "het group", id="het-group-out-of-range"),
    ],
)
def test_constructor_range_checks(kwargs, fragment):
    args = dict(rank=0, local_rank=0, world_size=2, master_addr="n1", master_port=29500)
    args.update(kwargs)
    with pytest.raises(WorldError, match=fragment):
        WorldInfo(**args)


def test_world_info_is_frozen():
    world = WorldInfo.from_env(het_env(1, "n3", 1, "v100"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        world.rank = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        world.master_addr = "n1"  # type: ignore[misc]


def test_to_dict_is_plain():
    world = WorldInfo.from_env(het_env(2, "n4", 2, "v100"))
    data = world.to_dict()
    assert data["rank"] == 2 and data["het_group"] == 1 and data["partition"] == "v100"
    assert WorldInfo(**data) == world


def test_from_env_does_not_mutate_env():
    env = het_env(0, "n1", 0, "a100")
    before = dict(env)
    WorldInfo.from_env(env)
    assert env == before


# --------------------------------------------------------------------------- hostlist
@pytest.mark.parametrize(
    "expr, hosts",
    [
        pytest.param("n1", ["n1"], id="single"),
        pytest.param("n[1,3-4]", ["n1", "n3", "n4"], id="merged-het-list"),
        pytest.param("n[3-4]", ["n3", "n4"], id="range"),
        pytest.param("gpu[08-10]", ["gpu08", "gpu09", "gpu10"], id="zero-padding-kept"),
        pytest.param("gpu[07-08]", ["gpu07", "gpu08"], id="zero-padding-2"),
        pytest.param("n[8-10]", ["n8", "n9", "n10"], id="no-padding"),
        pytest.param("a[1-2],b3", ["a1", "a2", "b3"], id="bracket-then-plain"),
        pytest.param(
            "rack[1-2]-n[1-2]",
            ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"],
            id="two-bracket-groups",
        ),
        pytest.param(
            "n[1,3-4],gpu[08-10]",
            ["n1", "n3", "n4", "gpu08", "gpu09", "gpu10"],
            id="docstring-example",
        ),
        pytest.param("host-a,host-b", ["host-a", "host-b"], id="plain-names"),
        pytest.param("", [], id="empty"),
    ],
)
def test_expand_hostlist(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    "expr",
    [
        pytest.param("n[1-", id="unclosed-bracket"),
        pytest.param("n[3-1]", id="descending-range"),
        pytest.param("n1]", id="unmatched-close"),
        pytest.param("n[a-b]", id="non-numeric-range"),
        pytest.param("n[]", id="empty-brackets"),
    ],
)
def test_expand_hostlist_malformed(expr):
    with pytest.raises(WorldError) as info:
        expand_hostlist(expr)
    assert repr(expr) in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- issue 8: hostlists
@pytest.mark.parametrize(
    "expr, hosts",
    [
        pytest.param("alpha beta", ["alpha", "beta"], id="space-separated"),
        pytest.param("alpha\tbeta\ngamma", ["alpha", "beta", "gamma"], id="any-whitespace"),
        pytest.param("n[1-2], gpu3", ["n1", "n2", "gpu3"], id="comma-and-space"),
        pytest.param(" n1 ", ["n1"], id="surrounding-space"),
    ],
)
def test_hostlist_whitespace_separates_hosts(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    "expr",
    ["n[\u00b2-3]", "n[\u0661-\u0663]", "n[1-\uff13]", "n[\u00b9]"],
    ids=["superscript", "arabic-indic", "fullwidth", "superscript-single"],
)
def test_hostlist_accepts_only_ascii_digits(expr):
    with pytest.raises(WorldError, match="ASCII digits"):
        expand_hostlist(expr, "SLURM_STEP_NODELIST")


@pytest.mark.parametrize(
    "expr", ["n[0-99999999999]", "a[0-300]b[0-300]", "n[0-65536]", "n[0-40000],m[0-40000]"]
)
def test_hostlist_past_slurm_limit_is_an_error_before_expanding(expr):
    with pytest.raises(WorldError, match="more than 65536 hosts"):
        expand_hostlist(expr, "SLURM_JOB_NODELIST")


def test_hostlist_at_slurm_limit_expands():
    assert len(expand_hostlist("n[0-65535]")) == 65536


@pytest.mark.parametrize("var", ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"])
def test_plain_job_hostlist_error_names_its_variable(var):
    env = plain_slurm_env(0, 0, "gpu07", 0)
    env.pop("SLURM_STEP_NODELIST")
    env[var] = "gpu[07-"
    with pytest.raises(WorldError) as info:
        WorldInfo.from_env(env)
    assert str(info.value).startswith(f"{var}='gpu[07-'"), str(info.value)


def test_het_job_hostlist_error_names_component_variable():
    env = {**het_env(0, "n1", 0, "a100"), "SLURM_JOB_NODELIST_HET_GROUP_0": "n[x]"}
    with pytest.raises(WorldError, match=r"^SLURM_JOB_NODELIST_HET_GROUP_0='n\[x\]'"):
        WorldInfo.from_env(env)


def test_space_separated_nodelist_gives_first_host_as_master():
    env = {**plain_slurm_env(0, 0, "alpha", 0), "SLURM_STEP_NODELIST": "alpha beta"}
    assert WorldInfo.from_env(env).master_addr == "alpha"


# --------------------------------------------------------------------------- issue 8: no srun
@pytest.mark.parametrize(
    "step",
    [None, "", "4294967294", "batch"],
    ids=["unset", "empty", "batch-step-number", "batch-word"],
)
def test_worker_in_batch_script_without_srun_is_refused(step):
    """The batch script's environment (measured: SLURM_JOB_ID and SLURM_PROCID=0 set, no
    SLURM_STEP_ID): rank 0 of SLURM_NTASKS would wait forever; refuse with one line."""
    env = _without(plain_slurm_env(0, 0, "gpu07", 0), "SLURM_STEP_ID")
    if step is not None:
        env["SLURM_STEP_ID"] = step
    with pytest.raises(WorldError) as info:
        WorldInfo.from_env(env)
    message = str(info.value)
    assert "srun" in message and "SLURM_STEP_ID" in message and "\n" not in message


def test_het_job_batch_script_without_srun_is_refused():
    env = _without(het_env(0, "n1", 0, "a100"), "SLURM_STEP_ID")
    with pytest.raises(WorldError, match="srun"):
        WorldInfo.from_env(env)


def test_srun_step_with_legacy_stepid_variable_is_accepted():
    env = {**_without(plain_slurm_env(1, 1, "gpu07", 0), "SLURM_STEP_ID"), "SLURM_STEPID": "0"}
    assert WorldInfo.from_env(env).rank == 1
