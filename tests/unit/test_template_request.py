"""A launcher's request to the rank-template server, in-process (no server started: the
served runs themselves are tests/integration/test_template_server.py)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from hetseq_hpc.files.atomic import current_umask
from hetseq_hpc.launch.template import ServedTemplate, TemplateError, TemplateRequest
from hetseq_hpc.launch.template_server import import_time_differences, unread_prefixes


def _request(pass_fds=(), received=()):
    return TemplateRequest(
        env={"A": "1"},
        cwd="/",
        umask=0o022,
        argv_tail=["--run-dir", "/r"],
        pass_fds=list(pass_fds),
        limits=TemplateRequest.current_limits(),
        cgroup=TemplateRequest.current_cgroup(),
        received=list(received),
    )


def test_only_import_time_variables_that_differ_refuse_a_server():
    mine = {"HOME": "/root", "TORCH_LOGS": "dynamo", "RANK": "0", "OMP_NUM_THREADS": "2"}
    theirs = {"HOME": "/root", "RANK": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": "5"}
    assert import_time_differences(mine, theirs) == ["TORCH_LOGS"]
    theirs.update(TORCH_LOGS="dynamo", GLOO_SOCKET_IFNAME="lo", TORCHINDUCTOR_CACHE_DIR="/c")
    assert import_time_differences(mine, theirs) == []  # read later, from the rank's own
    theirs.update(LD_PRELOAD="x.so", HF_HOME="/h", PYTHONPATH="/p")
    assert import_time_differences(mine, theirs) == ["HF_HOME", "LD_PRELOAD", "PYTHONPATH"]
    # a family read only by a library the server has not loaded does not count
    mine.update(LD_PRELOAD="x.so", HF_HOME="/h", PYTHONPATH="/p", KMP_DUPLICATE_LIB_OK="True")
    theirs.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    assert import_time_differences(mine, theirs) == [
        "HF_HUB_OFFLINE",
        "KMP_DUPLICATE_LIB_OK",
        "TRANSFORMERS_OFFLINE",
    ]
    unread = ("KMP_", "HF_", "TRANSFORMERS", "HUGGINGFACE")
    assert import_time_differences(mine, theirs, unread) == []


def test_a_family_counts_once_its_library_is_loaded(monkeypatch):
    """The HF family counts where transformers (or its kin) is imported; Intel's OpenMP
    family where libiomp is mapped (torch's CPU wheel maps GNU's)."""
    for name in ("huggingface_hub", "transformers", "datasets", "tokenizers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert unread_prefixes() == ("KMP_", "HF_", "TRANSFORMERS", "HUGGINGFACE")
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    assert unread_prefixes() == ("KMP_",)


def test_the_descriptors_land_where_the_template_expects_them():
    """stdin, stdout, stderr, then the status pipe and the launcher's pidfd at the lowest
    numbers the launcher's ``pass_fds`` leave free, each of those at its own number."""
    request = _request(pass_fds=[3, 9], received=[20, 21, 22, 23, 24, 25, 26])
    assert request.placement() == [(20, 0), (21, 1), (22, 2), (23, 4), (24, 5), (25, 3), (26, 9)]
    request = _request(received=[7, 8, 9, 10, 11])
    assert [t for _, t in request.placement()] == [0, 1, 2, 3, 4]


def test_a_request_round_trips_and_one_short_of_descriptors_is_refused():
    request = _request(pass_fds=[3])
    again = TemplateRequest.from_json(request.to_json(), [10, 11, 12, 13, 14, 15])
    assert again.to_json() == request.to_json() and again.received == [10, 11, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="5 descriptors for 1 pass_fds"):
        TemplateRequest.from_json(request.to_json(), [10, 11, 12, 13, 14])


def test_no_server_at_the_socket_is_one_template_error_and_leaks_no_descriptor(tmp_path):
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(TemplateError, match=r"no rank template server answers at .*none\.sock"):
        ServedTemplate.request(str(tmp_path / "none.sock"), {"A": "1"}, (), ["--run-dir", "/r"])
    assert set(os.listdir("/proc/self/fd")) == before


def test_the_current_umask_is_read_and_left_as_it_was():
    """A launcher's request carries its umask (the forked ranks' files get the user's modes):
    ``current_umask`` reads it without changing it."""
    before = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert current_umask() == 0o027  # still set: reading put it back
    finally:
        os.umask(before)
