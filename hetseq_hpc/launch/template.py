"""Local ranks forked from one template process that imported torch once (``cluster.start``).

A rank's ``import torch`` plus the ``torch._dynamo`` that ``torch.optim`` pulls in cost ~5 CPU-s
each on a CPU-only host; the template pays it once per run. docs/design/rank-template.md says
why forking is safe here, when the launcher execs instead, and what a forked rank looks like.
"""

from __future__ import annotations

import ast
import gc
import importlib
import importlib.util
import json
import logging
import os
import resource
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from hetseq_hpc.env.process_end import exit_now
from hetseq_hpc.files.atomic import current_umask

log = logging.getLogger(__name__)

#: modules every template imports before it forks (the template server too): torch and what
#: every rank imports next (``torch.distributed`` for the rendezvous, ``torch._dynamo`` from
#: ``torch.optim``); numpy comes with torch. A run's template adds, with its environment in
#: place, its task's ``rank_imports`` (``--preload``) and the worker's own imports
#: (``--imports-of``: hetseq_hpc's modules; :func:`preload_words`)
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


#: the variable naming a template server's socket (:mod:`hetseq_hpc.launch.template_server`):
#: a launcher that finds it asks the server for its template instead of starting one
SERVER_ENV = "HETSEQ_RANK_TEMPLATE_SERVER"
#: the resource limits a served template must share with its launcher (else it is refused)
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_STACK")
#: seconds a launcher waits for a template server's answer
SERVER_TIMEOUT_S = 10.0


@dataclass
class TemplateRequest:
    """What a launcher sends a template server: everything an exec'd template would have had
    from ``subprocess.Popen`` that a forked one must be given.

    ``received`` (server side) holds the descriptors that came with it, in this order: the
    request pipe's read end (the template's stdin), the launcher's stdout and stderr, the
    status pipe's write end, a pidfd of the launcher, then each of ``pass_fds``."""

    env: Dict[str, str]
    cwd: str
    umask: int
    argv_tail: List[str]
    pass_fds: List[int]
    limits: Dict[str, List[int]]
    cgroup: str
    received: List[int] = field(default_factory=list)

    @staticmethod
    def current_limits() -> Dict[str, List[int]]:
        """This process's :data:`LIMITS`, ``{name: [soft, hard]}``."""
        return {n: list(resource.getrlimit(getattr(resource, n))) for n in LIMITS}

    @staticmethod
    def current_cgroup() -> str:
        """This process's ``/proc/self/cgroup`` ("" where there is none)."""
        try:
            with open("/proc/self/cgroup", encoding="utf-8") as fh:
                return fh.read()
        except OSError:
            return ""

    def to_json(self) -> dict:
        """The request as JSON values (without ``received``)."""
        return {
            "env": self.env,
            "cwd": self.cwd,
            "umask": self.umask,
            "argv_tail": self.argv_tail,
            "pass_fds": self.pass_fds,
            "limits": self.limits,
            "cgroup": self.cgroup,
        }

    @classmethod
    def from_json(cls, data: dict, received: List[int]) -> TemplateRequest:
        """The request sent as ``data`` with the descriptors ``received`` beside it.

        Raises:
            ValueError: not as many descriptors as the request names.
        """
        request = cls(
            env={str(k): str(v) for k, v in data["env"].items()},
            cwd=str(data["cwd"]),
            umask=int(data["umask"]),
            argv_tail=[str(w) for w in data["argv_tail"]],
            pass_fds=[int(fd) for fd in data["pass_fds"]],
            limits={str(k): [int(x) for x in v] for k, v in data["limits"].items()},
            cgroup=str(data["cgroup"]),
            received=received,
        )
        if len(received) != 5 + len(request.pass_fds):
            raise ValueError(f"{len(received)} descriptors for {len(request.pass_fds)} pass_fds")
        return request

    def placement(self) -> List[Tuple[int, int]]:
        """``(received fd, its number in the template)`` for each received descriptor: 0, 1,
        2, then the status pipe and the launcher's pidfd at the lowest numbers free of
        ``pass_fds``, then each of ``pass_fds`` at its own number."""
        free = [n for n in range(3, 3 + 2 + len(self.pass_fds)) if n not in self.pass_fds][:2]
        targets = [0, 1, 2, *free, *self.pass_fds]
        return list(zip(self.received, targets))

    def close(self) -> None:
        """Close the received descriptors (the server's copies)."""
        for fd in self.received:
            try:
                os.close(fd)
            except OSError:
                pass
        self.received = []


class ServedTemplate:
    """A run's template forked by a template server rather than exec'd by the launcher: the
    part of :class:`subprocess.Popen`'s interface :class:`RankTemplate` uses. It is not this
    process's child: its exit status goes to the server (``wait`` returns None)."""

    def __init__(self, pid: int, pidfd: int, stdin_fd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.stdin = os.fdopen(stdin_fd, "wb")

    @classmethod
    def request(
        cls, path: str, env: Dict[str, str], pass_fds: Sequence[int], argv_tail: Sequence[str]
    ) -> Tuple[ServedTemplate, int]:
        """Ask the server listening on ``path`` for a template -> ``(it, the read end of its
        status pipe)``.

        Raises:
            TemplateError: no server answers there, or it refused (one line: why).
        """
        request_r, request_w = os.pipe()
        status_r, status_w = os.pipe()
        mine = [request_r, status_w]
        keep: List[int] = [request_w, status_r]
        try:
            mine.append(os.pidfd_open(os.getpid()))
            request = TemplateRequest(
                env=dict(env),
                cwd=os.getcwd(),
                umask=current_umask(),
                argv_tail=list(argv_tail),
                pass_fds=list(pass_fds),
                limits=TemplateRequest.current_limits(),
                cgroup=TemplateRequest.current_cgroup(),
            )
            body = json.dumps(request.to_json()).encode()
            fds = [request_r, 1, 2, status_w, mine[2], *pass_fds]
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(SERVER_TIMEOUT_S)
                conn.connect(path)
                socket.send_fds(conn, [struct.pack("!I", len(body))], fds)
                conn.sendall(body)
                answer, pidfds, _, _ = socket.recv_fds(conn, 4096, 1)
            words = answer.decode(errors="replace").strip().split(" ", 1)
            if words[0] != "forked" or len(pidfds) != 1:
                for fd in pidfds:
                    os.close(fd)
                raise TemplateError(
                    f"the rank template server at {path} did not serve this run: "
                    f"{words[-1] if words[0] == 'refused' else answer[:200]!r}"
                )
        except (OSError, ValueError) as exc:
            for fd in keep:
                os.close(fd)
            raise TemplateError(f"no rank template server answers at {path}: {exc}") from exc
        except TemplateError:
            for fd in keep:
                os.close(fd)
            raise
        finally:
            for fd in mine:
                os.close(fd)
        return cls(int(words[1]), pidfds[0], request_w), status_r

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait for the template's end -> None (its exit status went to the server).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"rank template pid {self.pid}", timeout or 0.0)
        return None

    def kill(self) -> None:
        """SIGKILL the template (through its pidfd: never a reused pid)."""
        signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


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
        server: the socket of a template server (:data:`SERVER_ENV`) to ask first: one that
            does not answer, or refuses (another environment, limits or cgroup), costs one
            info line and the template is started here as without it.
    """

    def __init__(
        self,
        env: Dict[str, str],
        pass_fds: Sequence[int] = (),
        preexec_fn: Optional[Callable[[], None]] = None,
        argv_tail: Sequence[str] = (),
        server: Optional[str] = None,
    ) -> None:
        self._proc: Union[subprocess.Popen, ServedTemplate]
        served = None
        if server:
            try:
                served = ServedTemplate.request(server, env, pass_fds, argv_tail)
            except TemplateError as exc:
                log.info("%s; starting this run's own rank template", exc)
        if served is not None:
            self._proc, status_r = served
            log.info(
                "the ranks fork from template pid %d of the server at %s", served[0].pid, server
            )
        else:
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
                code = self._proc.wait()
                raise TemplateError(
                    f"the rank template (pid {self.pid}) ended"
                    + ("" if code is None else f" with {code}")
                    + " before it started the rank"
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


def _serve(status_fd: int, launcher_fd: Optional[int] = None) -> Optional[dict]:
    """The template's loop: fork a rank per request on stdin, report ``started PID`` and
    ``exit PID CODE`` lines on ``status_fd``; exit at once when the launcher dies (its
    parent-death SIGHUP, or ``launcher_fd``, a pidfd of the launcher, turning readable: a
    template forked by a :mod:`~hetseq_hpc.launch.template_server` is not the launcher's
    child). Returns the request in a forked child (which then becomes the rank), None in the
    template at its end."""
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
        if launcher_fd is not None:
            readers.append(launcher_fd)
        try:
            ready, _, _ = select.select(readers, [], [], 1.0)
        except InterruptedError:
            continue
        if launcher_fd is not None and launcher_fd in ready:  # the launcher has exited
            os._exit(0)
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
                    if launcher_fd is not None:
                        os.close(launcher_fd)
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


def module_imports(module: str) -> List[str]:
    """The absolute imports at the top level of ``module``'s source (``import X`` and ``from X
    import ...``: X, in order, once; not those inside functions or ``if`` blocks), read
    without running it; ``[]`` when its source cannot be found or parsed."""
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        tree = ast.parse(Path(origin).read_text(encoding="utf-8")) if origin else None
    except (ImportError, OSError, SyntaxError, ValueError):
        return []
    names: List[str] = []
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in dict.fromkeys(names) if n != "__future__"]


def preload_words(argv: Sequence[str]) -> List[str]:
    """The modules a template's words ask it to import before it forks: those named by
    ``--preload MOD,...``, then those ``--imports-of MODULE`` imports at its top
    (:func:`module_imports`: the rank's own module, whose imports then cost each rank
    nothing); none without them."""
    named, imports_of = word_after(argv, "--preload"), word_after(argv, "--imports-of")
    names = [m for m in (named or "").split(",") if m]
    return names + (module_imports(imports_of) if imports_of else [])


def word_after(words: Sequence[str], flag: str) -> Optional[str]:
    """The word after ``flag`` in ``words`` (its first occurrence), None when ``flag`` is
    absent or last."""
    words = list(words)
    at = words.index(flag) + 1 if flag in words else len(words)
    return words[at] if at < len(words) else None


def run_template(status_fd: int, extra: Sequence[str], launcher_fd: Optional[int] = None) -> None:
    """A template's life once started (exec'd by :class:`RankTemplate`, or forked by the
    template server): import :data:`PRELOAD` and ``extra`` (already imported ones cost
    nothing), freeze the heap, serve fork requests (:func:`_serve`) and, in a forked child,
    become the rank. Call with the garbage collector disabled.

    The template itself ends with ``os._exit(0)`` once its ranks have: it ran no code but this
    module's (no thread, no atexit handler of its own), and the interpreter's teardown of
    torch's modules cost ~0.2 CPU-s and ~0.5 s of every run's end."""
    preload(extra)
    gc.freeze()
    request = _serve(status_fd, launcher_fd)
    if request is None:
        exit_now(0)
    _become_rank(request, status_fd)


def main() -> None:
    """``python -m hetseq_hpc.launch.template --status-fd FD [--preload MOD,...] [words]``:
    import :data:`PRELOAD` (and the ``--preload`` modules), then serve fork requests until
    stdin closes and every rank has ended."""
    status_fd = int(sys.argv[sys.argv.index("--status-fd") + 1])
    gc.disable()
    run_template(status_fd, preload_words(sys.argv))


if __name__ == "__main__":
    main()
