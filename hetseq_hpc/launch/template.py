"""Local ranks forked from one template process that imported torch once (``cluster.start``).

A rank's ``import torch`` plus the ``torch._dynamo`` that ``torch.optim`` pulls in cost ~5 CPU-s
each on a CPU-only host; the template pays it once per run. docs/design/rank-template.md says
why forking is safe here, when the launcher execs instead, and what a forked rank looks like.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

log = logging.getLogger(__name__)

#: modules the template imports before it forks: torch and what every rank imports next
#: (``torch.distributed`` for the rendezvous, ``torch._dynamo`` from ``torch.optim``); numpy
#: comes with torch. Nothing of hetseq_hpc: its modules read the rank's environment. A run
#: adds its task's ``rank_imports`` with ``--preload`` (:func:`preload`)
PRELOAD: Tuple[str, ...] = ("torch", "torch.distributed", "torch._dynamo")

#: ``prctl`` options (linux/prctl.h): a signal when the parent dies; the thread's name
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

#: the name a forked rank shows in ``ps -o comm`` / ``top`` (its command line is the
#: template's): ``hetseq-rank<N>``
NAME_PREFIX = "hetseq-rank"


#: the exit status given to a rank whose template died before it (the template sends its ranks
#: SIGHUP as it dies, and their real status died with it)
ORPHAN_CODE = -int(signal.SIGHUP)


class TemplateError(RuntimeError):
    """The template process could not start a rank (it died, or never came up)."""


class ForkedRank:
    """A rank forked by the template, with the part of :class:`subprocess.Popen`'s interface
    the launcher uses (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``). The template reaps it and reports its exit status, as Popen's:
    the exit code, or minus the signal that ended it."""

    def __init__(self, template: RankTemplate, pid: int) -> None:
        self._template = template
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        """The exit status if the rank has ended (reaped by the template), else None. A rank
        whose template died first (its status is lost with it) counts as ended by
        :data:`ORPHAN_CODE` once its process is gone."""
        if self.returncode is None:
            self._template.read_exits()
            self.returncode = self._template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the rank's end -> its exit status.

        Raises:
            subprocess.TimeoutExpired: not ended within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            self._template.wait_readable(0.2 if left is None else min(0.2, left))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the rank unless it has already ended (its pid may be reused)."""
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class RankTemplate:
    """Launcher side: start the template process and ask it for ranks.

    Args:
        env: the template's environment (a rank's without the rank's own variables: torch
            reads some variables when it is imported, and these are the same for every rank).
        pass_fds: descriptors every rank inherits (the run directory's lock).
        preexec_fn: run in the template before it starts (the launcher's parent-death signal).
        argv_tail: words shown after the module on the template's command line (the run
            directory, so that ``ps`` tells which run it serves).
    """

    def __init__(
        self,
        env: Dict[str, str],
        pass_fds: Sequence[int] = (),
        preexec_fn: Optional[Callable[[], None]] = None,
        argv_tail: Sequence[str] = (),
    ) -> None:
        status_r, status_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, "--status-fd", str(status_w), *argv_tail],
                env=env,
                stdin=subprocess.PIPE,
                process_group=0,
                preexec_fn=preexec_fn,
                pass_fds=(*pass_fds, status_w),
            )
        finally:
            os.close(status_w)
        self._status = os.fdopen(status_r, "rb", buffering=0)
        self._ended = False  # the template's end of file: it has exited
        self._buffer = b""
        self._exits: Dict[int, int] = {}
        self._started: List[int] = []
        self.pid = self._proc.pid

    def spawn(self, env: Dict[str, str], argv: Sequence[str], process_group: int = 0) -> ForkedRank:
        """Fork a rank running ``python -m MODULE ARGS`` (``argv`` = ``[-m, MODULE, *ARGS]``)
        with environment ``env`` in process group ``process_group`` (0: a new one it leads).

        Raises:
            TemplateError: the template has ended or did not answer (the caller may exec the
                rank instead).
        """
        if len(argv) < 2 or argv[0] != "-m":
            raise ValueError(f"argv must start with -m MODULE, got {list(argv)!r}")
        request = {"env": env, "argv": list(argv), "group": process_group}
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise TemplateError(f"the rank template (pid {self.pid}) has ended: {exc}") from exc
        while not self._started:
            if self._ended:
                raise TemplateError(
                    f"the rank template (pid {self.pid}) ended with {self._proc.wait()} "
                    "before it started the rank"
                )
            self._fill(0.5)
        return ForkedRank(self, self._started.pop(0))

    def _fill(self, timeout: float) -> None:
        """Take in what the template wrote within ``timeout`` s (sleeps that long once it has
        ended)."""
        if self._ended:
            time.sleep(timeout)
            return
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return
        chunk = self._status.read(65536)
        if not chunk:
            self._ended = True
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            kind, pid, *rest = line.decode().split()
            if kind == "started":
                self._started.append(int(pid))
            elif kind == "exit":
                self._exits[int(pid)] = int(rest[0])

    def read_exits(self) -> None:
        """Take in every exit status the template has reported so far (does not block)."""
        self._fill(0.0)

    def wait_readable(self, timeout: float) -> None:
        """Block up to ``timeout`` s for the template's next report."""
        self._fill(timeout)

    def exit_code(self, pid: int) -> Optional[int]:
        """The reported exit status of rank ``pid``, None while it runs; :data:`ORPHAN_CODE`
        once it is gone if the template ended without reporting it."""
        code = self._exits.get(pid)
        if code is None and self._ended and not _exists(pid):
            log.warning(
                "the rank template (pid %d) ended before rank pid %d: its exit status is lost "
                "(counted as SIGHUP, the signal it got as the template died)",
                self.pid,
                pid,
            )
            code = self._exits[pid] = ORPHAN_CODE
        return code

    def close(self) -> None:
        """No more ranks: the template exits once every rank it forked has ended."""
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass


#: a rank's process as the launcher holds it: exec'd, or forked from the template
RankProcess = Union[subprocess.Popen, ForkedRank]


def _exists(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ----------------------------------------------------------------------- the template process


def libc_prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl`` (ctypes), or None where it cannot be loaded (not Linux)."""
    import ctypes
    import ctypes.util

    path = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(path, use_errno=True).prctl if path else None
    except (OSError, AttributeError):
        return None


def _serve(status_fd: int) -> Optional[dict]:
    """The template's loop: fork a rank per request on stdin, report ``started PID`` and
    ``exit PID CODE`` lines on ``status_fd``; exit at once when the launcher dies. Returns the
    request in a forked child (which then becomes the rank), None in the template at its end."""
    children: set = set()
    closed = False
    launcher = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)

    def on_hup(signum, frame):
        # the launcher died (its parent-death signal): end at once, so that each rank gets
        # its own parent-death SIGHUP with its parent gone -- the launcher's store died too,
        # which a rank learns from exactly that (hetseq_hpc.env.preemption.StopRequest)
        if os.getppid() != launcher:
            os._exit(0)

    signal.signal(signal.SIGHUP, on_hup)
    signal.signal(signal.SIGCHLD, lambda s, f: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    pending = b""

    def report(text: str) -> None:
        try:
            os.write(status_fd, text.encode())
        except OSError:  # the launcher is gone: nobody to tell
            pass

    while True:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            report(f"exit {pid} {code}\n")
        if closed and not children:
            return None
        readers = [wake_r] if closed else [stdin, wake_r]
        try:
            ready, _, _ = select.select(readers, [], [], 1.0)
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        if stdin in ready:
            chunk = os.read(stdin.fileno(), 65536)
            if not chunk:
                closed = True
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                # no handler of the template's may run in the child: SIGHUP waits until the
                # child has its own (default) disposition
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
                request["template_pid"] = os.getpid()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for signum in (signal.SIGHUP, signal.SIGCHLD):
                        signal.signal(signum, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
                    os.close(wake_r)
                    os.close(wake_w)
                    return request
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
                children.add(pid)
                report(f"started {pid}\n")


def _become_rank(request: dict, status_fd: int) -> None:
    """In the forked child: leave the template's state and run the rank's module as
    ``__main__``, as ``python -m`` would; the interpreter then exits as a fresh one does."""
    os.close(status_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        os.setpgid(0, int(request["group"]))
    except OSError:  # every rank of that group has ended: a group of its own
        os.setpgid(0, 0)
    env = dict(request["env"])
    prctl = libc_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGHUP), 0, 0, 0)
        if os.getppid() != request["template_pid"]:  # the template died before prctl took effect
            os.kill(os.getpid(), signal.SIGHUP)
        name = f"{NAME_PREFIX}{env.get('RANK', '')}".encode()[:15]
        prctl(PR_SET_NAME, name, 0, 0, 0)
    os.environ.clear()
    os.environ.update(env)
    module, args = request["argv"][1], request["argv"][2:]
    sys.argv = [module, *args]
    gc.enable()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def preload(extra: Sequence[str] = ()) -> None:
    """Import :data:`PRELOAD`, then the run's ``extra`` modules (its task's ``rank_imports``):
    one that fails to import is left to the ranks, which import it again and say why."""
    for name in PRELOAD:
        importlib.import_module(name)
    for name in extra:
        try:
            importlib.import_module(name)
        except Exception:  # the rank's own import of it names the problem
            pass


def main() -> None:
    """``python -m hetseq_hpc.launch.template --status-fd FD [--preload MOD,...] [words]``:
    import :data:`PRELOAD` (and the ``--preload`` modules), then serve fork requests until
    stdin closes and every rank has ended."""
    status_fd = int(sys.argv[sys.argv.index("--status-fd") + 1])
    extra: List[str] = []
    if "--preload" in sys.argv:
        extra = [m for m in sys.argv[sys.argv.index("--preload") + 1].split(",") if m]
    gc.disable()
    preload(extra)
    gc.freeze()
    request = _serve(status_fd)
    if request is None:
        return
    _become_rank(request, status_fd)


if __name__ == "__main__":
    main()
