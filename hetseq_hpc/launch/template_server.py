"""A warm rank-template server: torch imported once, a run's template forked per launcher.

``python -m hetseq_hpc.launch.template_server --socket PATH`` and, for the launchers,
``HETSEQ_RANK_TEMPLATE_SERVER=PATH``: each local run forked from it skips the template's own
torch import (~3-6 CPU-s). docs/design/rank-template.md says what a served run gets and when
a launcher starts its own template instead.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import stat
import struct
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from hetseq_hpc.launch.template import (
    PR_SET_NAME,
    PR_SET_PDEATHSIG,
    SERVER_ENV,
    TemplateRequest,
    libc_prctl,
    preload,
    preload_words,
    run_template,
    word_after,
)

log = logging.getLogger(__name__)

__all__ = [
    "SERVER_ENV",
    "become_template",
    "import_time_differences",
    "listen",
    "main",
    "serve",
    "unread_prefixes",
]

#: variables whose value at ``import torch`` (or at the import of a module a task preloads)
#: can change what a process does: a launcher whose template environment differs from the
#: server's in one of them gets a template of its own instead (by name prefix)
IMPORT_TIME_PREFIXES = (
    "TORCH",
    "PYTORCH",
    "TRITON",
    "CUDA",
    "NCCL",
    "GLOO",
    "NVIDIA",
    "MKL",
    "KMP",
    "OMP_",
    "GOMP",
    "LD_",
    "PYTHON",
    "HF_",
    "TRANSFORMERS",
    "HUGGINGFACE",
    "XDG_",
    "HOME",
    "TMPDIR",
    "VIRTUAL_ENV",
)
#: variables of those that are read later, from the rank's own environment: the worker sets
#: its threads itself (docs/design/rank-template.md); gloo reads its interface when a group is
#: made; inductor its cache folder when it compiles (torch sets that one in a process that
#: asked for it, such as a launcher that imported torch)
IMPORT_TIME_EXEMPT = frozenset(
    {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME", "TORCHINDUCTOR_CACHE_DIR"}
)

#: the name the served templates show in ``ps -o comm``
TEMPLATE_NAME = "hetseq-template"


#: families of those variables read only by one library, when it loads: ``(prefixes, modules,
#: shared library)``. Where the server has loaded none of them, the family's values cannot have
#: changed what it imported (the served template imports such a module, a run's
#: ``--preload``, after taking the launcher's environment), and libraries set them in the
#: processes that use them: sklearn and joblib set ``KMP_*`` (Intel's OpenMP; torch's wheels
#: use GNU's), hetseq_hpc's own ``task=hf`` code sets ``HF_HUB_OFFLINE`` and its kin before it
#: imports transformers (a test process that ran either after its server started differed)
LIBRARY_FAMILIES = (
    (("KMP_",), (), "libiomp"),
    (
        ("HF_", "TRANSFORMERS", "HUGGINGFACE"),
        ("huggingface_hub", "transformers", "datasets", "tokenizers"),
        "",
    ),
)


def unread_prefixes() -> Tuple[str, ...]:
    """The prefixes of :data:`LIBRARY_FAMILIES` whose library this process has not loaded
    (from ``sys.modules`` and ``/proc/self/maps``; where that file cannot be read, a shared
    library counts as loaded: the strict answer)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            maps: Optional[str] = fh.read()
    except OSError:
        maps = None
    unread: List[str] = []
    for prefixes, modules, library in LIBRARY_FAMILIES:
        loaded = any(m in sys.modules for m in modules) or bool(
            library and (maps is None or library in maps)
        )
        if not loaded:
            unread.extend(prefixes)
    return tuple(unread)


def import_time_differences(
    mine: Dict[str, str], theirs: Dict[str, str], unread: Sequence[str] = ()
) -> List[str]:
    """The names of the variables of :data:`IMPORT_TIME_PREFIXES` (less
    :data:`IMPORT_TIME_EXEMPT` and less those starting with one of ``unread``: see
    :func:`unread_prefixes`) set differently, or set in only one, of ``mine`` and ``theirs``
    (sorted); empty when a template forked from ``mine`` imported what one started with
    ``theirs`` would have."""
    names = {k for k in (*mine, *theirs) if k.startswith(IMPORT_TIME_PREFIXES)}
    names = {k for k in names if not k.startswith(tuple(unread))}
    return sorted(k for k in names - IMPORT_TIME_EXEMPT if mine.get(k) != theirs.get(k))


def _receive(conn: socket.socket) -> TemplateRequest:
    """Read one launcher's request: a 4-byte length with its descriptors, then the JSON.

    Raises:
        OSError: the launcher went away or sent something else.
    """
    head, received, _, _ = socket.recv_fds(conn, 4, 64)
    try:
        if len(head) != 4:
            raise OSError("short request")
        (size,) = struct.unpack("!I", head)
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise OSError("request cut short")
            body += chunk
        request = TemplateRequest.from_json(json.loads(body), received)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        for fd in received:
            os.close(fd)
        raise OSError(f"bad template request: {exc}") from exc
    return request


def _refusal(request: TemplateRequest, unread: Sequence[str]) -> Optional[str]:
    """Why this server cannot stand in for the launcher's own template, or None (``unread``:
    :func:`unread_prefixes` of the server)."""
    differing = import_time_differences(dict(os.environ), request.env, unread)
    if differing:
        return f"its environment differs from the server's in {', '.join(differing[:5])}"
    if request.limits != TemplateRequest.current_limits():
        return "its resource limits differ from the server's"
    if request.cgroup != TemplateRequest.current_cgroup():
        return "it runs in another cgroup than the server"
    return None


def _place_fds(request: TemplateRequest) -> tuple:
    """In the forked child: put the received descriptors in place (stdin the request pipe,
    stdout and stderr the launcher's, each ``pass_fds`` one at its number in the launcher)
    and close every other one -> ``(status fd, launcher pidfd)``, their numbers here."""
    pairs = request.placement()
    floor = 1 + max([*(t for _, t in pairs), *(r for r, _ in pairs)])
    high = [(_dup_above(r, floor), t) for r, t in pairs]
    for fd, _ in pairs:
        os.close(fd)
    for fd, target in high:
        os.dup2(fd, target, inheritable=True)
    keep = {t for _, t in pairs}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:  # listdir's own descriptor, already closed
                pass
    return pairs[3][1], pairs[4][1]


def _dup_above(fd: int, floor: int) -> int:
    """A duplicate of ``fd`` numbered ``floor`` or above."""
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


def become_template(request: TemplateRequest) -> None:
    """In the forked child: become the launcher's template (its environment, directory, umask,
    descriptors, own process group) and run it (:func:`run_template`). Returns when the
    template (or, in a rank forked from it, the rank) ends: the interpreter then exits as a
    fresh one does (atexit, non-daemon threads), as ``python -m`` would."""
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    prctl = libc_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)  # outlives the server; the launcher is watched
        prctl(PR_SET_NAME, TEMPLATE_NAME.encode()[:15], 0, 0, 0)
    os.setpgid(0, 0)
    status_fd, launcher_fd = _place_fds(request)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    os.umask(request.umask)
    sys.path[0] = request.cwd  # what ``python -m`` started there would have
    sys.argv = [sys.argv[0], "--status-fd", str(status_fd), *request.argv_tail]
    run_template(status_fd, preload_words(request.argv_tail), launcher_fd)


def listen(path: str) -> socket.socket:
    """Claim ``path`` for the server's socket (only this user may connect: mode 0600 from
    the start) -> the listening socket. A socket left there by a server that no longer
    answers is replaced; anything else is kept.

    Raises:
        SystemExit: one line naming ``path`` and the fix: a file that is not a socket, or a
            server that still answers there (nothing is deleted).
    """
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SystemExit(
                f"template_server: error: --socket {path} exists and is not a socket; "
                "name a new path (nothing was changed)"
            )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:  # a stale socket: its server is gone
                os.unlink(path)
            else:
                raise SystemExit(
                    f"template_server: error: a server already answers at --socket {path}; "
                    "use it (HETSEQ_RANK_TEMPLATE_SERVER), or stop it first"
                )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(16)
    return listener


def _peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of ``conn`` (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def serve(listener: socket.socket, path: str) -> Optional[TemplateRequest]:
    """Fork a template per launcher's request on ``listener`` (:func:`listen` of ``path``),
    until SIGTERM (or the parent's death: the server gets SIGTERM as its parent-death
    signal). A connection of another user is refused (a template runs what its launcher
    names). Returns None in the server at its end (``path`` removed), the request in a forked
    child (which then becomes that launcher's template: :func:`become_template`)."""
    signal.signal(signal.SIGCHLD, lambda s, f: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda s, f: stopping.append(s))
    print(f"ready {os.getpid()}", flush=True)
    listener.settimeout(1.0)
    unread = unread_prefixes()
    while not stopping:
        while True:  # reap the templates that ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        try:
            conn, _ = listener.accept()
        except (TimeoutError, InterruptedError):
            continue
        with conn:
            conn.settimeout(10.0)
            if _peer_uid(conn) != os.getuid():
                _send(conn, "refused it runs as another user than the server\n")
                continue
            try:
                request = _receive(conn)
            except OSError as exc:
                log.warning("%s", exc)
                continue
            reason = _refusal(request, unread)
            if reason is not None:
                request.close()
                _send(conn, f"refused {reason}\n")
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.detach()
                return request
            request.close()
            pidfd = os.pidfd_open(pid)
            try:
                _send(conn, f"forked {pid}\n", [pidfd])
            finally:
                os.close(pidfd)
    listener.close()
    os.unlink(path)
    return None


def _send(conn: socket.socket, text: str, fds: Sequence[int] = ()) -> None:
    """Answer a launcher (a lost launcher is not the server's problem)."""
    try:
        if fds:
            socket.send_fds(conn, [text.encode()], list(fds))
        else:
            conn.sendall(text.encode())
    except OSError as exc:
        log.warning("the launcher did not take its answer: %s", exc)


def main() -> None:
    """``python -m hetseq_hpc.launch.template_server --socket PATH [--preload MOD,...]``:
    import torch (and the ``--preload`` modules) once, print ``ready PID``, then serve."""
    path = word_after(sys.argv[1:], "--socket")
    if path is None:
        raise SystemExit(
            "template_server: error: --socket PATH is missing; e.g. "
            "python -m hetseq_hpc.launch.template_server --socket /tmp/hetseq-templates.sock"
        )
    listener = listen(path)  # before the imports: a wrong path costs no torch import
    prctl = libc_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    gc.disable()
    preload(preload_words(sys.argv))
    gc.freeze()
    request = serve(listener, path)
    if request is not None:
        become_template(request)


if __name__ == "__main__":
    main()
