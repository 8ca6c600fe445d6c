"""Fixtures every folder uses: the shared token cache, tiny real data for the task tests, and
folders holding users' task modules (``user_task_dir``, ``breaches_dir``).

Layout: ``unit/`` (in-process: no subprocess, no second process, no Slurm), ``integration/``
(real worker processes over gloo, the CLI in a subprocess, the local launcher, faults in real
runs), ``slurm/`` (the real Slurm test cluster, marked ``slurm``), ``gpu/`` (CUDA only: skipped
without a GPU, run by ``scripts/gpu_check.sh`` on a lent one). Helpers that are not
fixtures live in ``tests/helpers/`` and are imported as ``tests.helpers.<module>``.

Tiers: bare ``pytest`` runs ``unit/`` only (minutes, between edits); ``--integration``,
``--slurm`` and ``--gpu`` add their folders, ``--all`` takes every tier (what
``scripts/run-tests.sh`` and CI run). A path named on the command line is always collected."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.shared import session_root
from tests.helpers.task_sources import BREACHES, USER_TASK, module_dir
from tests.helpers.tasks import write_task_data

TESTS = Path(__file__).resolve().parent
#: the opt-in tiers: folder under tests/ -> the option that adds it to a bare ``pytest``
OPT_IN_TIERS = {"integration": "--integration", "slurm": "--slurm", "gpu": "--gpu"}


def pytest_addoption(parser):
    group = parser.getgroup("hetseq_hpc tiers")
    for folder, flag in OPT_IN_TIERS.items():
        group.addoption(flag, action="store_true", help=f"also run tests/{folder}")
    group.addoption("--all", action="store_true", help="run every tier (as CI does)")


def _tier(path: Path):
    """The opt-in tier folder ``path`` lies in, or None (unit tests, helpers, the root)."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if parts and parts[0] in OPT_IN_TIERS else None


def _named_on_command_line(config, folder: str) -> bool:
    """Whether an argument of this pytest call names ``tests/<folder>`` or something in it."""
    for arg in config.invocation_params.args:
        arg = str(arg)
        if arg.startswith("-"):
            continue
        path = Path(config.invocation_params.dir, arg.split("::", 1)[0])
        if path.exists() and _tier(path) == folder:
            return True
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Let pytest keep its assertion-rewritten test modules (``__pycache__/*-pytest-*.pyc``)
    where ``PYTHONDONTWRITEBYTECODE=1`` (our 2-core VMs): pytest reads that cache in any case
    but writes it only when bytecode may be written, so every pytest process (each xdist
    worker, each tier) rewrote all ~100 test modules again, ~6 CPU-s a process. Only during
    collection; the tests' own subprocesses keep the variable."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


def pytest_ignore_collect(collection_path, config):
    folder = _tier(collection_path)
    if folder is None or config.getoption("--all") or config.getoption(OPT_IN_TIERS[folder]):
        return None
    return True if not _named_on_command_line(config, folder) else None


def pytest_runtest_logreport(report):
    """With ``HETSEQ_TEST_TIMES=<file>``, append each test phase's duration as it ends
    (``<seconds> <phase> <outcome> <node id> @<end, Unix time> <xdist worker>``): a suite's
    slow tests can be read while it runs (``--durations`` prints them only at its end), and
    when each worker ended its last test."""
    path = os.environ.get("HETSEQ_TEST_TIMES")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(
                f"{report.duration:9.2f} {report.when} {report.outcome} {report.nodeid} "
                f"@{time.time():.0f} {worker}\n"
            )


#: the integration files whose single tests run longest (1-2 minutes each in CI: several
#: multi-process runs, or compiling): handed out first, so that no worker starts one last
LONGEST_FIRST = (
    "test_compile_exact.py",
    "test_sharding_exact.py",
    "test_hf_exact.py",
    "test_hf_export.py",
)


def _order(item) -> tuple:
    tier = _tier(Path(str(item.path)))
    name = Path(str(item.path)).name
    first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    return ({"slurm": 0, "integration": 1, "gpu": 2}.get(tier or "", 3), first)


#: the tiers whose tests share one thing that is not per test (the one Slurm test cluster, the
#: one GPU): under ``pytest -n`` they run one after the other on a single worker
#: (``--dist loadgroup``, setup.cfg's default)
SERIAL_TIERS = ("slurm", "gpu")
#: at most this many xdist workers for ``-n auto`` (each imports torch and collects the suite)
MAX_AUTO_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (setup.cfg's default): the CPUs this process may use (its affinity and its
    cgroup's CPU quota: a container limited to 2 CPUs on a 64-core host gets 2), at most
    :data:`MAX_AUTO_WORKERS`; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides, as in xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    from hetseq_hpc.env.hardware import usable_cores

    return max(1, min(usable_cores(), MAX_AUTO_WORKERS))


def pytest_itemcollected(item):
    """A test of a serial tier joins its tier's xdist group (before xdist names the groups)."""
    tier = _tier(Path(str(item.path)))
    if tier in SERIAL_TIERS:
        item.add_marker(pytest.mark.xdist_group(tier))


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (``-m "not slurm"`` works); in a ``pytest-xdist`` worker
    (``-n N``, as ``scripts/run-tests.sh`` runs) put the long multi-process tiers first, their
    longest files first of all (:data:`LONGEST_FIRST`), and the many short unit tests last,
    which evens out the workers' ends (xdist hands out work in collection order; a stable sort
    keeps each file's own order)."""
    for item in items:
        folder = _tier(Path(str(item.path)))
        if folder is not None:
            item.add_marker(folder)
    if hasattr(config, "workerinput"):  # an xdist worker: its collection is what is run
        items.sort(key=_order)


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session, shared by its xdist workers (built by
    the first run; the cache's own file lock makes concurrent runs build it once). Shared
    because a tokenizer trained into a fresh cache is not the same twice (the losses differ at
    1e-4), and reference runs made once per session (``tests/helpers/shared.py``) are compared
    with runs on every worker."""
    cache = session_root(tmp_path_factory) / "token-cache"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


@pytest.fixture(scope="session")
def task_data_files(tmp_path_factory) -> dict:
    """Tiny real data of the image and translation tasks (:func:`write_task_data`)."""
    return write_task_data(tmp_path_factory.mktemp("task-data"))


@pytest.fixture
def user_task_dir(tmp_path) -> Path:
    """A folder for ``task.path`` holding ``my_tasks.py`` (:data:`~tests.helpers.task_sources.
    USER_TASK`): ``task=custom task.target=my_tasks.Regression``."""
    return module_dir(tmp_path, "my_tasks.py", USER_TASK)


@pytest.fixture
def breaches_dir(tmp_path) -> Path:
    """A folder for ``task.path`` holding ``breaches.py`` (:data:`~tests.helpers.task_sources.
    BREACHES`): a correct regression task and tasks that break the task contract."""
    return module_dir(tmp_path, "breaches.py", BREACHES)
