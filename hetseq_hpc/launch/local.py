"""``cluster=local``: start one worker process per rank on this machine and watch them.

Each rank is ``python -m hetseq_hpc.worker --config <run dir>/hetseq_config.yaml`` (CPU ranks
forked from one template process that imported torch once: ``cluster.rank_start``,
:mod:`hetseq_hpc.launch.template`) with the torch variables set (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``), exactly what torchrun would set, so the worker needs no special case. CPU
threads are split evenly between ranks. If a rank dies, the others get :data:`FAILURE_GRACE_S`
to exit (and write their own errors), then are stopped (they would otherwise wait in a
collective), and the rank whose own error came first is reported
with its reason and log file (:mod:`hetseq_hpc.launch.failures`).

The ranks die with their launcher: they run in their own process group (a terminal's Ctrl-C
reaches only the launcher), and the launcher sends every rank SIGTERM, once, when it stops for
any reason (an error, Ctrl-C, SIGTERM or SIGHUP): the ranks checkpoint after their current step
(SIGKILL after :data:`TERM_GRACE_S`). Each rank also gets a parent-death signal
(Linux ``prctl(PR_SET_PDEATHSIG, SIGHUP)``), so a SIGKILLed launcher still stops them, with a
watchdog in the worker as the last resort (:func:`hetseq_hpc.env.rank_guard.watch_launcher`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from hetseq_hpc.balance.placement import placement_for
from hetseq_hpc.config import RunConfig, planned_world_size, save_run_config
from hetseq_hpc.config.validate import visible_gpu_count
from hetseq_hpc.env.memcg import oom_evidence, oom_kill_counts
from hetseq_hpc.env.rank_guard import LAUNCHER_PID_ENV
from hetseq_hpc.env.world import free_port
from hetseq_hpc.errors import ConfigError, LaunchError
from hetseq_hpc.launch.command import command_env
from hetseq_hpc.launch.failures import (
    first_failure,
    read_error_file,
    signal_reason,
    storage_cause,
    survivors_stopped,
    too_few_message,
)
from hetseq_hpc.launch.template import (
    PR_SET_PDEATHSIG,
    SERVER_ENV,
    RankProcess,
    RankTemplate,
    TemplateError,
    libc_prctl,
)
from hetseq_hpc.rundir.events import append_event
from hetseq_hpc.rundir.lock import lock_run_dir
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.checkpoint.files import checkpoints_in

log = logging.getLogger(__name__)

#: variables of one rank's own, left out of the rank template's environment (each forked rank
#: gets its full environment when it is forked)
RANK_ONLY_ENV = ("RANK", "LOCAL_RANK")
#: the module every local rank runs (``python -m``), unless ``cluster.command`` names another
WORKER_MODULE = "hetseq_hpc.worker"

#: seconds between polls of the worker processes
POLL_S = 0.2
#: seconds a stopped worker gets between SIGTERM and SIGKILL
TERM_GRACE_S = 10.0
#: seconds the other ranks get to exit (and write their own error) after a rank failed
FAILURE_GRACE_S = 3.0
#: a rank the others left out may end itself within this many trainer.elastic.timeout_s
LEFT_OUT_GRACE = 3.0
#: reason given for a rank found stopped while its peers failed waiting for it
STOPPED_REASON = (
    "it was stopped (SIGSTOP or Ctrl-Z) and did not answer; its peers timed out waiting for it"
)


def check_ranks_fit_gpus(run: RunConfig, gpus: Optional[int] = None) -> None:
    """Refuse more local ranks than visible GPUs, before anything starts: every rank would be
    on CUDA and NCCL refuses two ranks of one group on one GPU (on an H100, 2026-11-27: "NCCL
    error ... invalid usage" at the rendezvous, after both ranks had started). A job whose
    ``cluster.devices`` put a rank on the CPU runs gloo on every rank, which two ranks on one
    GPU do not trouble: nothing is refused then.

    Args:
        run: the validated run configuration (``cluster=local``).
        gpus: visible GPUs; None = :func:`~hetseq_hpc.config.validate.visible_gpu_count`.

    Raises:
        ConfigError: ``cluster.ranks`` exceeds the visible GPUs; one line with both fixes.
    """
    gpus = visible_gpu_count() if gpus is None else gpus
    world = planned_world_size(run)
    kinds = run.cluster.device_kinds()
    if kinds and "cpu" in kinds:  # gloo for all (cluster.devices): it shares a GPU
        return
    if gpus and world > gpus:
        raise ConfigError(
            f"cluster.ranks={world} on a machine with {gpus} visible GPU(s): NCCL cannot run two "
            f"ranks on one GPU; use cluster.ranks={gpus} (or leave it unset: one rank per GPU), "
            f"or hide the GPUs (CUDA_VISIBLE_DEVICES= ) to run {world} ranks on the CPU"
        )


def rank_environments(run: RunConfig, config_path: Path) -> List[Dict[str, str]]:
    """The environment of every rank: the parent's environment plus the torch variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) and ``OMP_NUM_THREADS`` from the rank's placement. Nothing else: each
    worker resolves its own placement (threads, emulated speed, memory budget) from the config
    with :func:`hetseq_hpc.balance.placement.placement_for`."""
    cluster = run.cluster
    world = planned_world_size(run)
    port = cluster.master_port or free_port()
    envs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(placement_for(run, rank, local_world_size=world).threads),
                "PYTHONUNBUFFERED": "1",
                # Ctrl-C reaches the launcher, which stops the ranks with SIGTERM: they checkpoint
                # after the current step instead of dying inside a collective
                "HETSEQ_IGNORE_SIGINT": "1",
            }
        )
        envs.append(env)
    return envs


def _stop(procs: List[RankProcess]) -> None:
    """SIGTERM every running rank (its whole process group), SIGKILL what is left after
    :data:`TERM_GRACE_S`."""
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_all([proc], signal.SIGKILL)
            proc.wait()


def _signal_all(procs: List[RankProcess], signum: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                proc.send_signal(signum)
                if signum == signal.SIGTERM:  # a stopped rank (Ctrl-Z, SIGSTOP) must run to see it
                    proc.send_signal(signal.SIGCONT)


def _is_stopped(pid: int) -> bool:
    """True if process ``pid`` is stopped (state ``T``: SIGSTOP, Ctrl-Z; /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _die_with_parent(parent_pid: int) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that makes the child receive SIGHUP when this process dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), or None where prctl does not exist.

    SIGHUP, not SIGTERM: the kernel sends the parent-death signal when the parent *thread*
    ends (prctl(2)), and a SIGKILLed multi-threaded launcher (an elastic run's job store
    serves from threads) ends thread by thread, so a rank may get it several times. The
    worker takes any number of SIGHUPs as one stop request
    (:class:`~hetseq_hpc.env.preemption.StopRequest`), while a second SIGTERM would end it at
    once, before its checkpoint."""
    prctl = libc_prctl()
    if prctl is None:
        return None

    def setup() -> None:  # runs in the child between fork and exec
        prctl(PR_SET_PDEATHSIG, int(signal.SIGHUP), 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGHUP)

    return setup


class ElasticJob:
    """The job's store, served by the launcher for in-job recovery (``trainer.elastic``, DDP):
    no rank holds it, so losing any rank loses nothing
    (:mod:`hetseq_hpc.distributed.membership`). It listens on 127.0.0.1 only and serves only
    clients that prove they hold a random token given to the ranks in their environment
    (:mod:`hetseq_hpc.distributed.auth_store`)."""

    def __init__(self, store, token: str, grace_s: float = 0.0, world: int = 0, restarts: int = 0):
        self.store, self.token = store, token
        self.grace_s = grace_s  # a left-out rank's time to end itself before it is killed
        self.left_out: Dict[int, float] = {}  # rank -> time.monotonic() it was found left out
        self.ended: set = set()
        self.seen: Dict[int, int] = {}  # member -> exit code, as noticed
        self.early: List[int] = []  # ranks lost before every other rank could recover
        # grow back (trainer.elastic.restarts): the member id of each rank's current process
        # (a replacement gets a new one, above every original rank) and its restarts left
        self.member_of: List[int] = list(range(world))
        self.restarts_left: List[int] = [restarts] * world
        #: every rank holding the training state was lost while replacements waited to be
        #: admitted (nobody finished): :meth:`close_admissions` closed them; the run failed
        self.all_lost_at: Optional[int] = None

    @classmethod
    def serve(cls, run: RunConfig, envs: List[Dict[str, str]]) -> Optional[ElasticJob]:
        """Serve the store and tell the ranks where (``envs`` updated), or None when in-job
        recovery does not apply (off, FSDP, one rank)."""
        from hetseq_hpc.distributed.jobstore import (
            STORE_ENV,
            STORE_IN_PARENT_ENV,
            TOKEN_ENV,
            job_token,
            serve_job_store,
        )

        if not run.trainer.elastic.enabled or len(envs) < 2:
            return None
        token = job_token()
        store, port = serve_job_store("127.0.0.1", token=token)
        for env in envs:
            env.update({STORE_ENV: f"127.0.0.1:{port}", TOKEN_ENV: token, STORE_IN_PARENT_ENV: "1"})
        return cls(
            store,
            token,
            LEFT_OUT_GRACE * run.trainer.elastic.timeout_s,
            len(envs),
            run.trainer.elastic.restarts,
        )

    def close(self) -> None:
        """Stop serving the store (every rank has ended)."""
        self.store.close()

    @staticmethod
    def tolerated(code: int) -> bool:
        """A rank's exit the others survive: a signal (killed, lost) or 4 (left out)."""
        from hetseq_hpc.errors import EXIT_CODES, RankExcluded

        return code < 0 or code == dict(EXIT_CODES)[RankExcluded]

    def note_exits(self, procs: List[RankProcess], codes: Dict[int, int]) -> None:
        """For each rank newly found ended: tell the survivors at once (``gone/<rank>`` in the
        store: a re-forming world leaves it out without waiting for its heartbeat to go
        stale), and when it died before every living rank entered the training loop (its
        ``armed`` key), record it in :attr:`early`: those ranks wait for it in a start-up
        collective, not in a recovery, so the run ends now instead of after
        ``cluster.collective_timeout_s``."""
        from hetseq_hpc.distributed.jobstore import armed_key, gone_key

        for rank, code in codes.items():
            member = self._member(rank)
            if member in self.seen:
                continue
            self.seen[member] = code
            self.store.set(gone_key(member), str(code))
            if rank in self.left_out and rank not in self.ended:
                log.warning("rank %d ended itself after it was left out (exit %d)", rank, code)
            # a replacement is in no start-up collective with the others
            living = [r for r in range(len(procs)) if r not in codes and self._member(r) == r]
            if code != 0 and not self.store.check([armed_key(r) for r in living]):
                log.warning(
                    "rank %d ended (exit %d) before every rank could recover from a lost one "
                    "(start-up): ending the run",
                    rank,
                    code,
                )
                self.early.append(rank)

    def lost(self, rank: int, code: int) -> bool:
        """Whether rank ``rank``'s exit ``code`` is one the others survive (:meth:`tolerated`,
        and not before they could: :attr:`early`)."""
        return self.tolerated(code) and rank not in self.early

    def end_excluded(self, procs: List[RankProcess], codes: Dict[int, int]) -> None:
        """SIGKILL the ranks the others left out that did not end themselves within
        :attr:`grace_s` (:data:`LEFT_OUT_GRACE` x ``trainer.elastic.timeout_s``: a step's
        collective timeout and its recovery), or once every other rank has ended: a rank
        that was only cut off or stopped for a while finds out it was left out and ends with
        its one line (exit 4, writing nothing: :mod:`hetseq_hpc.files.fence`); a stopped
        process never does."""
        from hetseq_hpc.distributed.jobstore import excluded_key

        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank in codes or rank in self.ended:
                continue
            if rank not in self.left_out and self.store.check([excluded_key(self._member(rank))]):
                log.warning(
                    "rank %d was left out by the others (no heartbeat): ending it unless it "
                    "ends itself within %g s (or the others end first)",
                    rank,
                    self.grace_s,
                )
                self.left_out[rank] = now
            others_ended = all(r in codes for r in range(len(procs)) if r not in self.left_out)
            if rank in self.left_out and (
                now - self.left_out[rank] >= self.grace_s or others_ended
            ):
                log.warning("rank %d did not end itself: ending it", rank)
                _signal_all([proc], signal.SIGKILL)
                self.ended.add(rank)

    def _member(self, rank: int) -> int:
        """The member id of rank ``rank``'s current process."""
        return self.member_of[rank] if rank < len(self.member_of) else rank

    def replace_lost(
        self,
        procs: List[RankProcess],
        codes: Dict[int, int],
        spawn: Callable[[int, int], RankProcess],
    ) -> None:
        """Restart each rank lost (killed, or left out by the others: ended here, or by itself
        with exit 4; not a replacement the survivors refused) while it has restarts left (``trainer.elastic.restarts``) and the run goes on
        (no rank finished or failed): ``spawn(rank, member)`` starts the replacement, which joins the
        running job as a new member (:mod:`hetseq_hpc.distributed.admission`). Its exit code
        replaces the lost one's in ``codes`` (removed until it ends)."""
        from hetseq_hpc.distributed.admission import closed_key, refused_key, server_key

        ending = any(c == 0 or not self.lost(r, c) for r, c in codes.items())  # done, failed
        if ending or self.store.check([server_key(closed_key())]):
            return
        for rank, code in sorted(codes.items()):
            if code == 0 or not self.lost(rank, code) or rank >= len(self.restarts_left):
                continue
            if self.store.check([server_key(refused_key(self._member(rank)))]):
                continue  # its config or code differs: a restart would be refused again
            if self.restarts_left[rank] <= 0:
                continue
            self.restarts_left[rank] -= 1
            member = max([*self.member_of, *self.seen]) + 1  # never used before
            self.member_of[rank] = member
            log.warning(
                "rank %d was lost (%s): restarting it; it joins the running job at a step "
                "boundary as member %d (%d restart(s) left for rank %d)",
                rank,
                f"signal {-code}" if code < 0 else f"exit {code}",
                member,
                self.restarts_left[rank],
                rank,
            )
            procs[rank] = spawn(rank, member)
            self.ended.discard(rank)  # the new process has not been ended nor left out
            self.left_out.pop(rank, None)
            del codes[rank]

    def close_admissions(self, procs: List[RankProcess], codes: Dict[int, int]) -> None:
        """When every running rank is a replacement still waiting to be admitted, nobody is
        left to admit it: say so in the store (it ends by itself, exit 0). When no rank had
        finished either, every rank holding the training state was lost (two at once while
        the third's replacement waited): :attr:`all_lost_at` is set and the run fails."""
        from hetseq_hpc.distributed.admission import answer_key, closed_key, server_key

        running = [r for r in range(len(procs)) if r not in codes]
        waiting = [
            r
            for r in running
            if self._member(r) != r
            and not self.store.check([server_key(answer_key(self._member(r)))])
        ]
        if waiting and len(waiting) == len(running):
            if not any(code == 0 for code in codes.values()) and self.all_lost_at is None:
                # nobody finished: the last ranks holding the training state were lost
                self.all_lost_at = len(self.seen)
            self.store.set(server_key(closed_key()), "1")


class LauncherStopped(KeyboardInterrupt):
    """The launcher received SIGTERM or SIGHUP; handled like Ctrl-C (the ranks checkpoint)."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP to the launcher into :class:`LauncherStopped` for the ``with``
    block (main thread only), so the ranks are stopped and checkpoint as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise LauncherStopped(f"launcher received {signal.Signals(signum).name}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, previous in old.items():
            signal.signal(signum, previous)


def template_words(run: RunConfig, run_dir: Path) -> List[str]:
    """The rank template's words after ``--status-fd``: ``--run-dir RUN_DIR`` (shown in ``ps``);
    for a task whose config names ``rank_imports`` (``task=hf``: transformers), ``--preload
    MOD,...``; and, unless the ranks run the user's ``cluster.command``, ``--imports-of``
    :data:`WORKER_MODULE` (its own imports: hetseq_hpc's modules, omegaconf, ~0.5 CPU-s a
    rank). The template imports them once, with the run's environment in place, instead of
    every rank."""
    words = ["--run-dir", str(run_dir)]
    imports = getattr(run.task, "rank_imports", ())
    if imports:
        words += ["--preload", ",".join(imports)]
    if not run.cluster.command:
        words += ["--imports-of", WORKER_MODULE]
    return words


class RankStarter:
    """Starts the ranks' processes: forked from a :class:`RankTemplate` when there is one
    (``cluster.rank_start``), else ``cmd`` in a fresh interpreter (``subprocess.Popen``).
    Each gets a parent-death signal (:func:`_die_with_parent`; a forked rank's parent is the
    template, which gets one from the launcher) and joins ``group`` (0: a new process group).

    A template that has ended or does not answer is given up with one warning, and the
    remaining ranks are exec'd.
    """

    def __init__(self, cmd: List[str], pass_fds: tuple, template: Optional[RankTemplate]) -> None:
        self.cmd, self.pass_fds, self.template = cmd, pass_fds, template

    def start(self, env: Dict[str, str], group: int = 0) -> RankProcess:
        """Start one rank with environment ``env`` in process group ``group`` (its own when
        that group has ended) -> its process."""
        if self.template is not None:
            try:  # the forked rank watches its parent, the template
                forked_env = {**env, LAUNCHER_PID_ENV: str(self.template.pid)}
                return self.template.spawn(forked_env, self.cmd[1:], group)
            except TemplateError as exc:
                log.warning("%s; starting the ranks as new processes instead", exc)
                self.template = None
        preexec = _die_with_parent(os.getpid())
        try:
            return subprocess.Popen(
                self.cmd, env=env, process_group=group, preexec_fn=preexec, pass_fds=self.pass_fds
            )
        except (OSError, subprocess.SubprocessError):  # every rank of the group ended
            if not group:
                raise
            return subprocess.Popen(
                self.cmd, env=env, process_group=0, preexec_fn=preexec, pass_fds=self.pass_fds
            )

    def start_all(self, envs: List[Dict[str, str]]) -> List[RankProcess]:
        """One rank per environment, all in ONE new process group led by rank 0 (Ctrl-C in a
        terminal reaches only the launcher, which stops them in order)."""
        procs: List[RankProcess] = []
        for env in envs:
            group = procs[0].pid if procs and procs[0].poll() is None else 0
            procs.append(self.start(env, group))
        return procs


def rank_start_mode(run: RunConfig, gpus: Optional[int] = None) -> str:
    """How this run's ranks start: ``"fork"`` (from a :class:`RankTemplate`) or ``"exec"``,
    from ``cluster.rank_start`` (``auto``: fork when every rank is on the CPU and the ranks run
    hetseq_hpc's worker, not ``cluster.command``).

    Args:
        run: the validated run configuration (``cluster=local``).
        gpus: visible GPUs; None = :func:`~hetseq_hpc.config.validate.visible_gpu_count`.

    Raises:
        ConfigError: ``cluster.rank_start=fork`` with a rank on a GPU (CUDA in a forked
            process is only safe if the parent never touched it, which this launcher cannot
            promise for every driver) or with ``cluster.command``; nothing is started.
    """
    wanted = getattr(run.cluster, "rank_start", "auto")
    if wanted == "exec":
        return "exec"
    if run.cluster.command:
        if wanted == "fork":
            raise ConfigError(
                "cluster.rank_start=fork forks hetseq_hpc's worker, but cluster.command runs "
                f"your own program {list(run.cluster.command)}: use cluster.rank_start=auto"
            )
        return "exec"
    kinds = run.cluster.device_kinds()
    if kinds is not None:
        on_gpu = "cuda" in kinds
    else:
        on_gpu = (visible_gpu_count() if gpus is None else gpus) > 0
    if on_gpu:
        if wanted == "fork":
            raise ConfigError(
                "cluster.rank_start=fork with ranks on a GPU: forked processes and CUDA do not "
                "mix safely; use cluster.rank_start=auto (exec on GPUs) or hide the GPUs "
                "(CUDA_VISIBLE_DEVICES= )"
            )
        return "exec"
    return "fork"


def _failure_reason(
    run_dir: RunDir,
    rank: int,
    code: Optional[int],
    pid: Optional[int] = None,
    oom_before: Optional[Dict[str, int]] = None,
) -> str:
    """The words for a failed rank: its own error, else its signal. A SIGKILL is called out of
    memory only with the kernel's word for it (:func:`hetseq_hpc.env.memcg.oom_evidence`: the
    cgroup's OOM-kill count since ``oom_before``, or the kernel log naming ``pid``)."""
    err = read_error_file(run_dir.error_file(rank))
    if err is not None:
        return f"{err.get('type', 'Error')}: {err['message']}"
    if code is not None and code < 0:
        oom = oom_evidence(oom_before or {}, pid) if -code == signal.SIGKILL else None
        return signal_reason(code, run_dir, rank, oom)
    return f"exit code {code}"


def _watch(
    procs: List[RankProcess],
    poll_s: float,
    job: Optional[ElasticJob] = None,
    spawn: Optional[Callable[[int, int], RankProcess]] = None,
) -> Dict[int, int]:
    """Wait until every rank exited, or a rank failed and the others had
    :data:`FAILURE_GRACE_S` to exit on their own; returns rank -> exit code of the ranks that
    exited by themselves (before anyone stopped them). With ``job`` (in-job recovery), a rank
    lost to a signal or left out by the others (exit 4; a stopped one is ended here) is not a
    failure: the survivors go on without it; with ``spawn`` (``trainer.elastic.restarts``) it
    is restarted (:meth:`ElasticJob.replace_lost`; ``procs`` then holds the new process)."""
    codes: Dict[int, int] = {}
    failed_at: Optional[float] = None
    while len(codes) < len(procs):
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is not None and rank not in codes:
                codes[rank] = code
        if job is not None:
            job.note_exits(procs, codes)
            job.end_excluded(procs, codes)
            if spawn is not None:
                job.replace_lost(procs, codes, spawn)
                job.close_admissions(procs, codes)
        if failed_at is None and any(
            c != 0 and not (job and job.lost(r, c)) for r, c in codes.items()
        ):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            break
        if len(codes) < len(procs):
            time.sleep(poll_s)
    return codes


def launch_local(run: RunConfig, run_dir: RunDir, poll_s: float = POLL_S) -> Dict:
    """Run the job on this machine and return rank 0's summary.

    The run directory is locked for the whole run (:func:`~hetseq_hpc.rundir.lock.lock_run_dir`;
    the ranks inherit the lock). SIGTERM/SIGHUP to the launcher stop the ranks after their
    current step (they checkpoint) and raise :class:`LauncherStopped`, a ``KeyboardInterrupt``.

    Raises:
        ConfigError: more ranks than visible GPUs (:func:`check_ranks_fit_gpus`); nothing started.
        LaunchError: the run directory is in use by another run, or a rank failed; the others
            were stopped; the message names the rank whose own error came first, the reason and
            its log file (a rank that could not even write its error file on a full or
            read-only run directory: that cause, found by ``os.statvfs``).
    """
    check_ranks_fit_gpus(run)
    mode = rank_start_mode(run)
    run_dir = run_dir.resolve()
    with lock_run_dir(run_dir) as lock, _stop_on_signals():
        return _launch(run, run_dir, poll_s, lock.child_env(), (lock.fd,), mode)


def _launch(
    run: RunConfig,
    run_dir: RunDir,
    poll_s: float,
    lock_env: Dict[str, str],
    pass_fds: tuple,
    mode: str = "exec",
) -> Dict:
    config_path = save_run_config(run, run_dir.config)
    for stale in run_dir.error_files():
        stale.unlink()
    envs = rank_environments(run, config_path)
    for env in envs:
        env.update(lock_env)
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        if Path("/sys/class/net/lo").exists():  # gloo's pair sockets on loopback only, too
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    log.info(
        "starting %d rank(s) on this machine (%s threads each); run directory %s",
        len(envs),
        envs[0].get("OMP_NUM_THREADS", "?"),
        run_dir,
    )
    cmd = [
        sys.executable,
        "-m",
        WORKER_MODULE,
        "--config",
        str(config_path),
        "--run-dir",
        str(run_dir),
    ]
    if run.cluster.command:  # the user's script on every rank (hetseq_hpc.launch.command)
        cmd = list(run.cluster.command)
        envs = [command_env(run_dir, env) for env in envs]
    procs: List[RankProcess] = []
    template: Optional[RankTemplate] = None
    oom_before = oom_kill_counts()  # the ranks inherit this cgroup: did the OOM killer act?
    job = None if run.cluster.command else ElasticJob.serve(run, envs)
    try:
        if mode == "fork":
            base = {k: v for k, v in envs[0].items() if k not in RANK_ONLY_ENV}
            template = RankTemplate(
                base,
                pass_fds,
                _die_with_parent(os.getpid()),
                template_words(run, run_dir),
                server=os.environ.get(SERVER_ENV),
            )
        starter = RankStarter(cmd, pass_fds, template)
        procs = starter.start_all(envs)

        group = procs[0].pid  # the ranks' process group (rank 0 leads it)

        def spawn(rank: int, member: int) -> RankProcess:
            """Start a replacement of rank ``rank`` as member ``member``, in the ranks' group
            while it still exists (else its own)."""
            from hetseq_hpc.distributed.admission import JOIN_ENV, MEMBER_ENV

            return starter.start({**envs[rank], MEMBER_ENV: str(member), JOIN_ENV: "1"}, group)

        restarts = job is not None and run.trainer.elastic.restarts > 0
        codes = _watch(procs, poll_s, job, spawn if restarts else None)
        if job is not None and job.all_lost_at is not None:
            newest = checkpoints_in(run_dir.checkpoints)
            raise LaunchError(
                "every rank holding the training state was lost before a replacement could be "
                f"admitted (after {job.all_lost_at} lost process(es)): nobody was left to send "
                "it the state; "
                + (
                    f"the last checkpoint is {newest[-1]}: run the same command again to go on "
                    "from it (trainer.resume=auto, the default)"
                    if newest
                    else "no checkpoint was written (trainer.checkpoint_every)"
                )
            )
        # a rank lost before every rank could recover from it (start-up) is a failure
        elastic = job if job is not None and not job.early else None
        if elastic and codes and all(elastic.lost(r, c) or c == 0 for r, c in codes.items()):
            lost = sorted(r for r, c in codes.items() if c != 0)
            if lost:
                log.warning("rank(s) %s were lost; the others finished the run without them", lost)
            if len(lost) == len(procs):
                raise LaunchError(
                    f"every rank was lost ({_failure_reason(run_dir, 0, codes[0])}"
                    f"); see {run_dir.rank_log(0)}"
                )
        elif elastic and survivors_stopped(codes, elastic.tolerated):
            lost = sorted(r for r, c in codes.items() if elastic.tolerated(c))
            raise LaunchError(
                too_few_message(
                    run_dir,
                    lost,
                    [_failure_reason(run_dir, r, codes[r], procs[r].pid, oom_before) for r in lost],
                )
            )
        elif any(c != 0 for c in codes.values()):
            errors = {r: read_error_file(run_dir.error_file(r)) for r in range(len(procs))}
            errors = storage_cause(run_dir, codes, errors)  # no room even for an error file
            stopped = [r for r, p in enumerate(procs) if r not in codes and _is_stopped(p.pid)]
            _stop(procs)
            failed = first_failure(codes, errors, stopped)
            own = errors.get(failed)
            if own is not None:  # its error file, or a full or read-only run directory
                reason = f"{own.get('type', 'Error')}: {own['message']}"
            elif failed in stopped:
                reason = STOPPED_REASON
            else:
                reason = _failure_reason(
                    run_dir, failed, codes.get(failed), procs[failed].pid, oom_before
                )
            raise LaunchError(
                f"rank {failed} failed ({reason}); the other ranks were stopped; see "
                f"{run_dir.rank_log(failed)}"
            )
    except BaseException as exc:
        _stop(procs)
        if isinstance(exc, KeyboardInterrupt) and procs:  # after the ranks' own stop row
            cause = str(exc) if isinstance(exc, LauncherStopped) else "Ctrl-C (SIGINT)"
            append_event(run_dir, "stopped_by", cause=cause)
        raise
    finally:
        if template is not None:
            template.close()
        if job is not None:
            job.close()
    summary_path = run_dir.summary
    return json.loads(summary_path.read_text()) if summary_path.is_file() else {}
