"""The rank-template server (``HETSEQ_RANK_TEMPLATE_SERVER``, docs/design/rank-template.md):
real server processes, real launchers, real forks; nothing mocked. Every other integration
test's local runs are served too (``tests/integration/conftest.py``); these check that a served
run is the run a launcher's own template gives, that a server is refused where it could differ,
and that a served template dies with its launcher, which is not its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hetseq_hpc.launch.template import SERVER_ENV, ServedTemplate
from tests.helpers.runs import (
    SMALL_MODEL,
    cli_env,
    hetseq,
    losses,
    run_processes,
    start_hetseq,
    wait_rows,
)
from tests.helpers.waits import wait_for

RUN = [
    *SMALL_MODEL,
    "cluster.ranks=2",
    "balance.allocation=[20,12]",  # measured shares differ run to run, and so would the losses
    "trainer.max_steps=3",
    "trainer.plot=false",
]
SERVED = "the ranks fork from template pid"
REFUSED = "did not serve this run"


@pytest.fixture
def server(tmp_path):
    """A template server of this test's own on ``<tmp>/s.sock`` (its environment this
    process's, without the session's server variable) -> the socket's path."""
    path = str(tmp_path / "s.sock")
    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetseq_hpc.launch.template_server", "--socket", path],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("ready"), "the server did not start"
        yield path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _env(token_cache: Path, server: str = "", **extra: str) -> dict:
    env = {k: v for k, v in cli_env(token_cache).items() if k != SERVER_ENV}
    if server:
        env[SERVER_ENV] = server
    return {**env, **extra}


def _cli_log(run_dir: Path) -> str:
    return (run_dir / "cli.log").read_text()


@pytest.mark.slow
def test_a_served_run_is_the_run_of_its_own_template_and_a_differing_one_is_refused(
    tmp_path, token_cache, server
):
    """The same 2-rank run three ways -- forked from the server, from a template of its own
    (no server named), and with an import-time variable the server does not share
    (``TORCH_SHOW_CPP_STACKTRACES``): refused in one info line naming it, its own template
    then. The three log the same loss at every step, bit for bit."""
    runs = {
        "served": _env(token_cache, server),
        "own": _env(token_cache),
        "refused": _env(token_cache, server, TORCH_SHOW_CPP_STACKTRACES="1"),
    }
    for name, env in runs.items():
        proc = hetseq(*RUN, f"hydra.run.dir={tmp_path / name}", env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert SERVED in _cli_log(tmp_path / "served")
    assert SERVED not in _cli_log(tmp_path / "own") and REFUSED not in _cli_log(tmp_path / "own")
    refused = [line for line in _cli_log(tmp_path / "refused").splitlines() if REFUSED in line]
    assert len(refused) == 1 and "TORCH_SHOW_CPP_STACKTRACES" in refused[0], refused
    assert SERVED not in _cli_log(tmp_path / "refused")
    want = losses(tmp_path / "own")
    assert sorted(want) == [1, 2, 3]
    assert losses(tmp_path / "served") == want
    assert losses(tmp_path / "refused") == want


@pytest.mark.slow
def test_no_server_at_the_named_socket_costs_one_line_and_the_run_goes_on(tmp_path, token_cache):
    env = _env(token_cache, str(tmp_path / "nothing-here.sock"))
    proc = hetseq(*RUN, f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in _cli_log(tmp_path / "run").splitlines() if "template server" in line]
    assert len(lines) == 1 and "nothing-here.sock" in lines[0], lines
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]


@pytest.mark.slow
def test_sigkill_to_the_launcher_ends_its_served_template_and_ranks(tmp_path, token_cache, server):
    """The served template is the server's child, not the launcher's: it watches the launcher
    through a pidfd and ends at once when it dies; the ranks then get their parent-death
    SIGHUP, checkpoint and exit. The server lives on."""
    run_dir = tmp_path / "run"
    proc = start_hetseq(
        *RUN,
        "trainer.max_steps=100000",
        "optim.schedule_steps=100000",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={run_dir}",
        env=_env(token_cache, server),
        new_session=True,
    )
    try:
        wait_rows(run_dir, 3, proc)
        found = list(run_processes(run_dir))
        assert sorted(r for _, r, _ in found if r is not None) == [0, 1], found
        assert [r for _, r, _ in found].count(None) == 1, "no served template found"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(  # a guard against hangs, not a speed check
            lambda: not [p for p, _, state in run_processes(run_dir) if state != "Z"],
            "the served template and its ranks gone",
            120,
            poll_s=0.2,
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted((run_dir / "checkpoints").glob("step_*.pt")), "the ranks wrote no checkpoint"
    assert SERVED in _cli_log(run_dir)
    again = hetseq(*RUN, f"hydra.run.dir={tmp_path / 'after'}", env=_env(token_cache, server))
    assert again.returncode == 0, again.stderr[-3000:]
    assert SERVED in _cli_log(tmp_path / "after"), "the server did not outlive the launcher"


@pytest.mark.slow
def test_the_suites_runs_are_served_after_libraries_set_their_own_variables(
    rank_template_server, tmp_path, token_cache, monkeypatch
):
    """The session's server serves what every test's run looks like (``cli_env``), also
    after code run in the test process set variables of a library the server never loaded:
    ``KMP_DUPLICATE_LIB_OK`` (sklearn, joblib, threadpoolctl at import; only Intel's OpenMP
    reads it) and ``HF_HUB_OFFLINE`` and its kin (hetseq_hpc's ``task=hf`` code). Without
    this every run of the suite started its own template again (CI runs 33 and 34)."""
    if rank_template_server is None:
        pytest.skip("the session's template server is off (HETSEQ_TEST_TEMPLATE_SERVER=0)")
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")
    monkeypatch.setenv("KMP_INIT_AT_FORK", "FALSE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    proc = hetseq(*RUN, f"hydra.run.dir={tmp_path / 'run'}", token_cache=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert SERVED in _cli_log(tmp_path / "run"), _cli_log(tmp_path / "run")[-2000:]


def _start_server(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetseq_hpc.launch.template_server", *words],
        env={k: v for k, v in os.environ.items() if k != SERVER_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_server_never_takes_a_path_it_should_not_and_says_so_in_one_line(tmp_path, server):
    """Before any import: a regular file at ``--socket`` is kept as it was, a live server's
    socket is left to it (it still serves), and a missing ``--socket`` names the fix."""
    results = tmp_path / "results.json"
    results.write_text('{"kept": true}')
    for words, wanted in (
        (["--socket", str(results)], f"--socket {results} exists and is not a socket"),
        (["--socket", server], f"a server already answers at --socket {server}"),
        ([], "--socket PATH is missing"),
    ):
        done = _start_server(*words)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert lines[0].startswith("template_server: error: ") and wanted in lines[0], lines
    assert results.read_text() == '{"kept": true}'
    assert os.stat(server).st_mode & 0o777 == 0o600  # only its user may connect
    served, status = ServedTemplate.request(server, dict(os.environ), (), ["--run-dir", "/x"])
    served.stdin.close()  # no ranks: the template ends, the server went on serving
    os.close(status)
    assert served.wait(timeout=120) is None
