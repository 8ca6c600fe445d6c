"""Running the real CLI in a subprocess with a small model, and reading what a run left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from hetseq_hpc.rundir.lock import LOCK_NAME
from hetseq_hpc.train.metrics import read_metrics
from tests.helpers.waits import wait_for

REPO = Path(__file__).resolve().parent.parent.parent

#: the rank template's module on a forked rank's command line, and the start of its name
TEMPLATE_MODULE = b"hetseq_hpc.launch.template"
#: the module of a template server (:mod:`hetseq_hpc.launch.template_server`): the command
#: line of the templates it forks and of their ranks
SERVER_MODULE = b"hetseq_hpc.launch.template_server"
#: a served template's name (``/proc/<pid>/comm``)
SERVED_TEMPLATE_NAME = "hetseq-template"
RANK_NAME = "hetseq-rank"

#: A small BERT so multi-process runs take seconds on 2 CPU cores.
SMALL_MODEL = [
    "task.model.hidden_size=64",
    "task.model.num_layers=2",
    "task.model.num_heads=2",
    "task.model.intermediate_size=128",
    "task.model.max_seq_len=64",
]

#: relative tolerance of the loss equivalence tests (derived in the docstring of
#: tests/integration/test_training.py)
REL_TOL = 1e-5


def cli_env(token_cache: Path) -> Dict[str, str]:
    """This process's environment for a CLI run: ``token_cache`` as the token cache
    (``HETSEQ_CACHE``), unbuffered output, and no ``RANK``/``WORLD_SIZE`` of an outer job."""
    env = dict(os.environ)
    env["HETSEQ_CACHE"] = str(token_cache)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def hetseq_cmd(*args: str, module: str = "hetseq_hpc", plot: bool = False) -> List[str]:
    """``python -m MODULE ARGS`` with this interpreter: the CLI (``hetseq_hpc``) by default, or
    another module run the same way (``hetseq_hpc.worker``, ``hetseq_hpc.plan``, ...).

    A training run (the CLI with overrides, no subcommand) gets ``trainer.plot=false`` unless
    ``plot`` or ARGS name ``trainer.plot``: drawing ``ranks.png`` costs ~0.6 s of CPU per run
    (matplotlib), spent hundreds of times by a suite that looks at the plot in a few tests
    (those pass ``plot=True``; ``report`` draws it on its own)."""
    words = [a for a in args if not a.startswith("-")]
    is_run = module == "hetseq_hpc" and bool(words) and all("=" in w for w in words)
    if is_run and not plot and not any(w.startswith("trainer.plot=") for w in words):
        args = (*args, "trainer.plot=false")
    return [sys.executable, "-m", module, *args]


def _env(token_cache: Optional[Path], env: Optional[Dict[str, str]]) -> Optional[Dict[str, str]]:
    """``env`` if given, else :func:`cli_env` of ``token_cache`` if given, else None (this
    process's environment)."""
    if env is not None:
        return env
    return cli_env(token_cache) if token_cache is not None else None


def hetseq(
    *args: str,
    token_cache: Optional[Path] = None,
    cwd: Path = REPO,
    env: Optional[Dict[str, str]] = None,
    timeout: Optional[float] = 600,
    module: str = "hetseq_hpc",
    plot: bool = False,
    **run: Any,
) -> subprocess.CompletedProcess:
    """Run :func:`hetseq_cmd` ``(*args, module=module, plot=plot)`` to its end -> CompletedProcess with
    text stdout and stderr (``run`` goes to :func:`subprocess.run`).

    The environment is ``env``, else :func:`cli_env` ``(token_cache)``, else this process's.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (a guard against
            hangs).
    """
    return subprocess.run(
        hetseq_cmd(*args, module=module, plot=plot),
        cwd=cwd,
        env=_env(token_cache, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        **run,
    )


def start_hetseq(
    *args: str,
    token_cache: Optional[Path] = None,
    cwd: Path = REPO,
    env: Optional[Dict[str, str]] = None,
    module: str = "hetseq_hpc",
    plot: bool = False,
    new_session: bool = False,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    text: bool = True,
    **popen: Any,
) -> subprocess.Popen:
    """Start :func:`hetseq_cmd` ``(*args, module=module, plot=plot)`` in the background -> Popen (text
    pipes by default; ``popen`` goes to :class:`subprocess.Popen`, e.g. ``preexec_fn``).

    The environment is chosen as by :func:`hetseq`. ``new_session``: its own session and
    process group, so that the test can signal the whole group (``os.killpg(proc.pid, ...)``).
    """
    return subprocess.Popen(
        hetseq_cmd(*args, module=module, plot=plot),
        cwd=cwd,
        env=_env(token_cache, env),
        stdout=stdout,
        stderr=stderr,
        text=text,
        start_new_session=new_session,
        **popen,
    )


def run_ok(
    run_dir: Path, token_cache: Path, *overrides: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``python -m hetseq_hpc OVERRIDES hydra.run.dir=RUN_DIR`` that must exit 0 (else the
    tail of its stderr); returns it."""
    proc = hetseq(*overrides, f"hydra.run.dir={run_dir}", token_cache=token_cache, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


def assert_ok(proc) -> None:
    """``proc`` exited 0 (else its output's tails)."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    )


def snapshot(run_dir: Path, skip=(".hetseq.lock",)) -> Dict[str, bytes]:
    """Every file under ``run_dir`` (relative path -> bytes) but those whose relative path
    starts with one of ``skip`` (the lock file records its last holder's pid)."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(Path(run_dir).rglob("*"))
        if p.is_file() and not str(p.relative_to(run_dir)).startswith(tuple(skip))
    }


def read_rows(run_dir: Path) -> List[dict]:
    """Rows of a run's metrics.jsonl (:func:`hetseq_hpc.train.metrics.read_metrics`)."""
    return read_metrics(run_dir)


def losses(run_dir: Path) -> Dict[int, float]:
    """step -> training loss of a run (step rows only: not a membership event's row)."""
    return {row["step"]: row["loss"] for row in read_rows(run_dir) if "loss" in row}


def assert_same_losses(a: dict, b: dict, steps) -> None:
    """The losses of ``steps`` agree to :data:`REL_TOL` relative."""
    for step in steps:
        assert step in a and step in b, f"step {step} missing"
        rel = abs(a[step] - b[step]) / abs(a[step])
        assert rel <= REL_TOL, f"step {step}: {a[step]} vs {b[step]} (relative {rel:.2e})"


def step_rows(run_dir: Path) -> int:
    """How many step rows (rows with a ``loss``: not a membership event's) ``run_dir``'s
    metrics.jsonl has so far (0 before it exists)."""
    path = Path(run_dir) / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def wait_rows(
    run_dir: Path, n: int, proc: Optional[subprocess.Popen] = None, timeout_s: float = 300
) -> None:
    """Wait until ``run_dir/metrics.jsonl`` has ``n`` rows (:func:`~tests.helpers.waits.
    wait_for`: fails when ``proc`` ended first; the timeout is a guard against hangs, not a
    speed check)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    wait_for(
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= n,
        f"{metrics} did not reach {n} rows",
        timeout_s,
        proc=proc,
        poll_s=0.2,
    )


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a CLI the test will Ctrl-C: SIGINT back to its default action.

    A shell without job control starts background commands with SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: a suite started as ``(bash scripts/run-tests.sh
    &)`` would hand that to every CLI it starts, and a test's Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def processes() -> Iterator[Tuple[int, List[bytes], Dict[bytes, bytes], str]]:
    """``(pid, argv, environment, state)`` of every readable process (from /proc; ``state``
    is the letter of ``/proc/<pid>/stat``: "Z" a zombie, "T" stopped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(
                item.partition(b"=")[::2] for item in (entry / "environ").read_bytes().split(b"\0")
            )
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        yield int(entry.name), argv, environ, state


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (from /proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _comm(pid: int) -> str:
    """Process ``pid``'s name (``/proc/<pid>/comm``; "" when gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def run_processes(run_dir: Path) -> Iterator[Tuple[int, Optional[int], str]]:
    """``(pid, rank, state)`` of every process the local launcher started for the run in
    ``run_dir``: each rank -- exec'd (``python -m hetseq_hpc.worker --run-dir RUN_DIR``, its
    rank from ``RANK``) or forked from the rank template (the template's command line, its
    rank from its name ``hetseq-rank<N>``: ``cluster.rank_start``) -- and the template itself
    (rank None)."""
    marker = str(run_dir).encode()
    for pid, argv, env, state in processes():
        if SERVER_MODULE in argv:  # forked by a template server: its command line is the server's
            name = _comm(pid)
            served = name.startswith(RANK_NAME) or name == SERVED_TEMPLATE_NAME
            if not served or not _holds_lock_of(pid, run_dir):
                continue
        elif marker not in b" ".join(argv):
            continue
        if b"hetseq_hpc.worker" in argv and b"RANK" in env:
            yield pid, int(env[b"RANK"]), state
        elif TEMPLATE_MODULE in argv or SERVER_MODULE in argv:
            name = _comm(pid)
            rank = int(name[len(RANK_NAME) :]) if name.startswith(RANK_NAME) else None
            yield pid, rank, state


def _holds_lock_of(pid: int, run_dir: Path) -> bool:
    """Whether process ``pid`` holds a descriptor of ``run_dir``'s lock file (a served
    template and its ranks inherit the launcher's: :mod:`hetseq_hpc.rundir.lock`)."""
    lock = os.path.realpath(Path(run_dir) / LOCK_NAME)
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) == lock:
                return True
        except OSError:
            continue
    return False


def worker_pids(run_dir: Path, live: bool = False) -> Dict[int, int]:
    """rank -> pid of the worker processes of ``run_dir`` (:func:`run_processes`); ``live``:
    zombies left out (they count as gone)."""
    return {
        rank: pid
        for pid, rank, state in run_processes(run_dir)
        if rank is not None and not (live and state == "Z")
    }
