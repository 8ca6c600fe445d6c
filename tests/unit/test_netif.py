"""gloo's and NCCL's interface from this node's route to the master (hetseq_hpc.env.netif):
the real kernel route where one exists on every machine (loopback), a table of interfaces
where a test needs another node's (a namespace's address on a bridge)."""

from __future__ import annotations

from hetseq_hpc.env.netif import (
    Route,
    interface_of,
    route_to,
    set_socket_ifname,
    spans_nodes,
    use_route_to_master,
)
from hetseq_hpc.env.world import WorldInfo

#: a node in a network namespace: its veth on a bridge, and loopback
NODE = {"lo": ("127.0.0.1", "255.0.0.0"), "hsq1p3": ("10.231.7.13", "255.255.255.0")}

HET_JOB = {
    "SLURM_JOB_ID": "12",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "3",
    "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "n1",
    "SLURM_HET_SIZE": "2",
    # component 0 on v100 = n[3-4]: rank 0 runs on n3, the merged sorted list starts at n1
    "SLURM_JOB_NODELIST": "n[1,3-4]",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n3",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n[1,4]",
    "SLURM_NTASKS_HET_GROUP_0": "1",
    "SLURM_NTASKS_HET_GROUP_1": "2",
}


def test_the_interface_holding_the_source_address_else_the_network_containing_it():
    assert interface_of("10.231.7.13", NODE) == "hsq1p3"
    assert interface_of("127.0.0.11", NODE) == "lo"  # 127.0.0.1/8
    assert interface_of("192.0.2.2", NODE) is None


def test_the_real_route_to_a_loopback_master_is_lo():
    assert route_to("127.0.0.1") == Route("127.0.0.1", "127.0.0.1", "lo")
    assert route_to("no-such-host.invalid") is None


def test_route_to_another_node_uses_the_interface_that_holds_the_source_address():
    got = route_to("10.231.7.11", interfaces=lambda: NODE, source=lambda master: "10.231.7.13")
    assert got == Route("10.231.7.11", "10.231.7.13", "hsq1p3")


def test_both_variables_are_set_from_the_route_unless_the_user_set_them():
    route = Route("10.231.7.11", "10.231.7.13", "hsq1p3")
    env: dict = {}
    assert set_socket_ifname("n1", env, True, route=lambda _: route) == (
        route,
        ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"],
    )
    assert env == {"GLOO_SOCKET_IFNAME": "hsq1p3", "NCCL_SOCKET_IFNAME": "hsq1p3"}
    env = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert set_socket_ifname("n1", env, True, route=lambda _: route)[1] == ["NCCL_SOCKET_IFNAME"]
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"


def test_a_loopback_route_sets_nothing_when_the_job_spans_nodes():
    """rank 0 whose host name resolves to 127.0.1.1 must not bind gloo to lo while the other
    nodes reach it over the network; one node alone may."""
    route = Route("127.0.1.1", "127.0.0.1", "lo")
    env: dict = {}
    assert set_socket_ifname("n1", env, True, route=lambda _: route) == (route, [])
    assert env == {}
    assert set_socket_ifname("n1", env, False, route=lambda _: route)[1] == [
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
    ]


def test_only_a_slurm_job_on_one_node_is_known_not_to_span_nodes():
    het = WorldInfo.from_env(HET_JOB)
    assert spans_nodes(het, HET_JOB)
    one = {**HET_JOB, "SLURM_JOB_NODELIST": "n3"}
    assert not spans_nodes(WorldInfo.from_env(one), one)
    torch_env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert spans_nodes(WorldInfo.from_env(torch_env), torch_env)


def test_a_het_job_routes_to_rank_0s_node_not_the_merged_lists_first():
    """The route is asked for het component 0's first node (n3), where rank 0 runs: the
    merged node list's first (n1) would be another node's address."""
    world = WorldInfo.from_env(HET_JOB)
    assert world.master_addr == "n3"
    asked = []
    set_socket_ifname(world.master_addr, {}, True, route=lambda host: asked.append(host))
    assert asked == ["n3"]


def test_one_rank_asks_for_no_route():
    single = WorldInfo(rank=0, local_rank=0, world_size=1, master_addr="n1", master_port=1)
    env: dict = {}
    assert use_route_to_master(single, env) is None and env == {}


def test_a_loopback_master_of_several_ranks_is_logged_and_leaves_gloo_alone(caplog):
    world = WorldInfo(rank=1, local_rank=1, world_size=2, master_addr="127.0.0.1", master_port=1)
    env: dict = {}
    with caplog.at_level("INFO", logger="hetseq_hpc.env.netif"):
        assert use_route_to_master(world, env) == Route("127.0.0.1", "127.0.0.1", "lo")
    assert env == {}
    assert "address 127.0.0.1, interface lo" in caplog.text
