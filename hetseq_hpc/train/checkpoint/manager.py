"""The checkpoints of a run directory: atomic, checksummed, loaded without running code.

:class:`CheckpointManager` is the one object that saves (:meth:`~CheckpointManager.save`,
every rank calls it; the strategy writes the model and optimizer state, :class:`StateIO`),
chooses and loads (:meth:`~CheckpointManager.load`), keeps the newest (retention), verifies
and moves bad files to ``checkpoints/corrupt/`` (quarantine).

* ``step_XXXXXXXX.pt`` is written through :func:`hetseq_hpc.files.atomic.atomic_write` (temp
  file, fsync, rename) with its SHA-256 sidecar, verified before it is unpickled and read with
  ``torch.load(weights_only=True)``: a crafted file cannot run code.
* A full disk (``OSError`` ENOSPC, or the ``RuntimeError`` torch's serializer raises instead)
  or a read-only one removes the temp file, keeps the earlier checkpoints and raises one line
  naming the device.
* ``trainer.checkpoint_async``: the state (a sharded save: every rank's shards) is staged to
  CPU memory and written in the background; the next save and ``finish`` wait for it.
* Retention counts only checkpoints that VERIFY and belong to the current run (their
  ``run_id``, :mod:`hetseq_hpc.rundir.history`); it never deletes the checkpoint just written
  nor a newer one; a file that fails its checksum is moved to ``checkpoints/corrupt/``.
Sharded (FSDP) checkpoints, in the background too: docs/design/checkpoints.md.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import logging
import os
import pickle
import re
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import (
    IO,
    Any,
    BinaryIO,
    Callable,
    Collection,
    Dict,
    List,
    Optional,
    Protocol,
    Tuple,
    Union,
    cast,
)

import torch
import torch.distributed as dist

from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.distributed.rendezvous import Rendezvous
from hetseq_hpc.errors import CheckpointError, RankFenced
from hetseq_hpc.files.atomic import atomic_write, atomic_write_text, remove_stale_temps
from hetseq_hpc.files.fence import check_write, stamp
from hetseq_hpc.files.user_input import file_problem
from hetseq_hpc.rundir.history import current_run_id, start_or_continue
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.rundir.storage import filesystem_problem, fix_for, write_problem
from hetseq_hpc.train.checkpoint.background import (
    BackgroundWrite,
    ShardStager,
    Stager,
    hold_for_tests,
)
from hetseq_hpc.train.checkpoint.files import (
    CORRUPT_DIR,
    FIX,
    checkpoint_name,
    checkpoints_in,
    checksum_path,
    sha256_file,
    step_of,
    stored_state,
    verify_checksum,
)
from hetseq_hpc.train.checkpoint.shards import (
    METADATA,
    rank_files,
    shard_dir_name,
    shard_dirs,
    sweep_orphans,
    write_manifest,
)
from hetseq_hpc.train.checkpoint.shards import verify_shards as check_shards

log = logging.getLogger(__name__)

#: bump when the checkpoint layout changes (2: checksummed, plain-data rng states, config)
FORMAT_VERSION = 2
#: entries every checkpoint must hold
REQUIRED = ("model", "optimizer", "scheduler", "step")

#: checkpoints already verified by this process: path -> ((size, mtime_ns), run id or "")
_VERIFIED: Dict[str, Tuple[tuple, str]] = {}

#: ``state(tensors)``: the checkpoint's content, with the model and optimizer state or without
#: them (a sharded checkpoint's record): :meth:`hetseq_hpc.train.trainer.Trainer.state_dict`
StateFn = Callable[[bool], Dict[str, Any]]


class StateIO(Protocol):
    """The model and optimizer state I/O of a strategy (:mod:`hetseq_hpc.train.parallel`):
    how a checkpoint's tensors are written (the whole state by rank 0, or every rank its
    shards) and read back."""

    def save_state(
        self,
        checkpoints: CheckpointManager,
        step: int,
        rdv: Gang,
        optimizer: torch.optim.Optimizer,
        state: StateFn,
    ) -> Path:
        """Checkpoint ``step`` through ``checkpoints`` (a collective); returns its record."""
        ...

    def load_state(
        self, optimizer: torch.optim.Optimizer, state: Dict[str, Any], source: str
    ) -> None:
        """Load a checkpoint's model and optimizer state (a collective under FSDP)."""
        ...


class _HashingWriter:
    """A write-only file object that hashes what passes through and keeps the first OSError
    (torch's serializer turns it into a RuntimeError without errno)."""

    def __init__(self, fh: BinaryIO):
        self.fh = fh
        self.sha = hashlib.sha256()
        self.error: Optional[OSError] = None

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.fh.flush()


@dataclass
class ResumeChoice:
    """The checkpoint a run resumes from, decided on rank 0.

    Attributes:
        path: the checkpoint, or None to start from step 0.
        state: its loaded content (rank 0 only; None when ``path`` is None).
        skipped: ``(bad file, one-line reason)`` of newer checkpoints that did not verify.
        others: ``(file, one-line reason)`` of newer checkpoints another run wrote (passed
            over, never resumed, kept in place).
    """

    path: Optional[Path] = None
    state: Optional[Dict[str, Any]] = None
    skipped: List[Tuple[Path, str]] = field(default_factory=list)
    others: List[Tuple[Path, str]] = field(default_factory=list)


def require_entries(state: Any, source: str) -> None:
    """Raise a one-line :class:`CheckpointError` if ``state`` lacks an entry of :data:`REQUIRED`."""
    missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {source!r} has no {', '.join(missing)} entry: it is not a complete "
            "hetseq_hpc checkpoint; point trainer.resume at one this version wrote, or set "
            "trainer.resume=never"
        )


def load_checkpoint(path: Union[str, Path], verify_shards: bool = True) -> Dict[str, Any]:
    """Verify and read a checkpoint onto the CPU, running no code from the file. A sharded
    checkpoint's record is returned without its tensors (its ``shards`` entry names them), after
    :func:`hetseq_hpc.train.checkpoint.shards.verify_shards` (every file's checksum when
    ``verify_shards``, else its list and metadata only).

    Raises:
        CheckpointError: the file is missing, fails its checksum, is refused by safe loading
            (it holds Python objects: treated as untrusted), is truncated, or is not a complete
            hetseq_hpc checkpoint; the one-line message names the file and how to go on.
    """
    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise CheckpointError(
            f"checkpoint {str(path)!r} {problem}: check trainer.resume, or set "
            "trainer.resume=auto to use the latest checkpoint of the run directory"
        )
    verify_checksum(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch puts the refused construct after "WeightsUnpickler error:", often on a later line
        found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(exc))
        detail = found.group(1).strip().rstrip(".") if found else "unsupported content"
        raise CheckpointError(
            f"checkpoint {str(path)!r} is refused as untrusted: safe loading (weights_only) found "
            f"Python objects in it ({detail}): resume only from checkpoints hetseq_hpc wrote, "
            "or set trainer.resume=never"
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or unreadable ({type(exc).__name__}): {FIX}"
        ) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a hetseq_hpc checkpoint of format {FORMAT_VERSION}: "
            "point trainer.resume at one written by this version, or set trainer.resume=never"
        )
    require_entries(state, str(path))
    if "shards" in state:
        check_shards(path, state, full=verify_shards)
    return state


def verified_run_id(path: Path) -> str:
    """:func:`~hetseq_hpc.train.checkpoint.files.verify_checksum` (and a sharded checkpoint's
    files), then its run id; cached per file size and mtime, so retention hashes each
    checkpoint once per process.

    Raises:
        CheckpointError: the checkpoint does not verify or cannot be read.
    """
    info = Path(path).stat()
    key = (
        info.st_size,
        info.st_mtime_ns,
        tuple(  # a sharded checkpoint: its files too
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for d in shard_dirs(path)
            for f in sorted(d.iterdir())
        ),
    )
    cached = _VERIFIED.get(str(path))
    if cached is not None and cached[0] == key:
        return cached[1]
    verify_checksum(path)
    state = stored_state(path)
    if "shards" in state:  # a sharded checkpoint verifies only with all its files
        check_shards(path, state)
    recorded = state.get("run_id")
    run_id = recorded if isinstance(recorded, str) else ""
    _VERIFIED[str(path)] = (key, run_id)
    return run_id


class CheckpointManager:
    """The checkpoints of one run directory (``<run dir>/checkpoints``).

    Args:
        run_dir: the run directory.
        keep: ``trainer.keep_checkpoints`` (>= 1): verified checkpoints of the current run
            kept by retention.
        asynchronous: ``trainer.checkpoint_async``: :meth:`save_on_rank0` and
            :meth:`save_sharded_in_background` write in the background (a CPU copy of the
            state is kept for it).
        timeout_s: how long a collective of a background sharded write waits
            (``cluster.collective_timeout_s``).
    """

    def __init__(
        self,
        run_dir: RunDir,
        keep: int = 1,
        asynchronous: bool = False,
        timeout_s: float = 1800.0,
    ):
        self.run_dir = run_dir
        self.keep = int(keep)
        self.asynchronous = bool(asynchronous)
        self.timeout_s = float(timeout_s)
        #: TEST-ONLY: called with the step after a checkpoint's bytes are in its temp file and
        #: before it is renamed into place (:func:`~hetseq_hpc.train.checkpoint.background.
        #: hold_for_tests`)
        self.test_hold: Callable[[int], None] = hold_for_tests
        #: called with the step once a checkpoint's record is in place (by the process and
        #: thread that wrote it: a background write's thread), e.g. to mark it in events.jsonl:
        #: a background write abandoned or failed is never marked; its errors are one warning
        self.on_written: Optional[Callable[[int], None]] = None
        self._pending: Optional[BackgroundWrite] = None
        #: the gang's group (``rdv.cpu_group``) of the world a pending sharded write began in
        #: (None: none pending, or a write of rank 0 alone)
        self._pending_world: Optional[dist.ProcessGroup] = None
        self._stager: Optional[Stager] = None
        self._shard_stager: Optional[ShardStager] = None
        #: ``(rdv.cpu_group, group)``: the world's gloo group of background sharded writes
        self._group: Optional[Tuple[Optional[dist.ProcessGroup], dist.ProcessGroup]] = None

    # ------------------------------------------------------------------ names
    @property
    def directory(self) -> Path:
        """``<run dir>/checkpoints``."""
        return self.run_dir.checkpoints

    def path(self, step: int) -> Path:
        """Path of the checkpoint after optimizer step ``step``."""
        return self.directory / checkpoint_name(step)

    def list(self) -> List[Path]:
        """The run directory's checkpoint files (regular files named ``step_XXXXXXXX.pt``),
        oldest step first."""
        return checkpoints_in(self.directory)

    def referenced_shard_dirs(self) -> set:
        """Names of the shard directories the run directory's records reference."""
        names = set()
        for path in self.list():
            try:
                shards = stored_state(path).get("shards")
            except CheckpointError:
                continue
            if isinstance(shards, dict) and isinstance(shards.get("dir"), str):
                names.add(shards["dir"])
        return names

    def sweep_orphan_shards(self) -> List[Path]:
        """:func:`~hetseq_hpc.train.checkpoint.shards.sweep_orphans` of the run directory's
        checkpoints (rank 0, at the start of a run)."""
        return sweep_orphans(self.directory, self.referenced_shard_dirs())

    # ------------------------------------------------------------------ writing
    def kept_words(self, final: Path) -> str:
        """What is left after the checkpoint ``final`` could not be written: the newest earlier
        one (it is what ``trainer.resume=auto`` takes), or that there is none."""
        earlier = [p for p in self.list() if p != final]
        return (
            f"the earlier checkpoint {earlier[-1].name} is kept"
            if earlier
            else "no earlier checkpoint exists"
        )

    def write_error(
        self,
        final: Path,
        exc: BaseException,
        seen: Optional[OSError] = None,
        problem: Optional[str] = None,
    ) -> CheckpointError:
        """One-line CheckpointError for a failed write of checkpoint ``final`` (``seen``: the
        first OSError the writer saw; ``problem``: a full or read-only filesystem found
        otherwise, see :mod:`hetseq_hpc.rundir.storage`); names the mount point when the disk
        is full or read-only."""
        run_dir = self.run_dir
        chain: List[BaseException] = [seen] if seen else []
        cause: Optional[BaseException] = exc
        while cause is not None:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        in_way = next((p for p in (final, checksum_path(final)) if p.is_dir()), None)
        if in_way is not None:  # a directory at the checkpoint's (or its checksum's) name
            return CheckpointError(
                f"could not write checkpoint {str(final)!r}: {str(in_way)!r} is a directory, "
                f"not a file: remove or rename it, then continue with hetseq-hpc "
                f"hydra.run.dir={run_dir} trainer.resume=auto"
            )
        kept = self.kept_words(final)
        problem = problem or next(
            (found for found in (write_problem(e, final.parent) for e in chain) if found), None
        )
        if problem and problem.startswith("no space left"):
            return CheckpointError(
                f"{problem} (writing checkpoint {str(final)!r}; {kept}): free space or move "
                f"hydra.run.dir, then continue with hetseq-hpc hydra.run.dir={run_dir} "
                "trainer.resume=auto"
            )
        if problem:
            return CheckpointError(
                f"{problem} (writing checkpoint {str(final)!r}; {kept}): "
                f"{fix_for(problem, run_dir)}"
            )
        reason = next((s for s in (getattr(e, "strerror", None) for e in chain) if s), None)
        return CheckpointError(
            f"could not write checkpoint {str(final)!r} ({reason or type(exc).__name__}; "
            f"{kept}): free disk space or fix permissions"
        )

    def write(self, state: Dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (plus its SHA-256 sidecar) on this
        process; keep the newest :attr:`keep` checkpoints (:meth:`retain`). A corrupt
        checkpoint of the same step is moved to ``checkpoints/corrupt/`` first, not
        overwritten.

        Raises:
            CheckpointError: the file cannot be written (disk full, permissions); the temporary
                file is removed and earlier checkpoints are untouched.
        """
        final = self.path(step)
        payload = dict(state, format_version=FORMAT_VERSION, step=step, **stamp())
        box: Dict[str, _HashingWriter] = {}

        def write(fh: BinaryIO) -> None:
            box["w"] = _HashingWriter(fh)
            torch.save(payload, cast(IO[bytes], box["w"]))  # it needs write() and flush()
            self.test_hold(step)
            # the sidecar before the checkpoint's rename: a write stopped between the two (a
            # full disk, or the write fence: a rank cut off from the job's store) leaves no
            # checkpoint without its checksum, at most a sidecar without its checkpoint
            digest = box["w"].sha.hexdigest()
            atomic_write_text(checksum_path(final), f"{digest}  {final.name}\n", durable=True)

        shards = payload.get("shards")
        self.set_aside_corrupt(
            final, [shards["dir"]] if isinstance(shards, dict) and "dir" in shards else []
        )
        try:
            atomic_write(final, write, durable=True)
        except (OSError, RuntimeError) as exc:
            writer = box.get("w")
            raise self.write_error(final, exc, writer.error if writer else None) from None
        self.retain(final, payload.get("run_id"))
        log.info("checkpoint: %s", final)
        if self.on_written is not None:
            try:
                self.on_written(step)
            except RankFenced:  # cut off or left out: the rank's own line says so, once
                log.warning("checkpoint of step %d written; not marked (this rank is fenced)", step)
            except Exception as exc:  # a mark of a written checkpoint: never its failure
                log.warning("checkpoint of step %d written; marking it failed: %s", step, exc)
        return final

    def save(
        self,
        step: int,
        rdv: Gang,
        strategy: StateIO,
        optimizer: torch.optim.Optimizer,
        state: StateFn,
    ) -> Path:
        """Checkpoint ``step`` (a collective: EVERY rank calls it): the strategy writes the
        model and optimizer state its way (:meth:`StateIO.save_state`: rank 0 the whole state,
        :meth:`save_on_rank0`, or every rank its shards, :meth:`save_sharded`).

        Returns:
            The checkpoint's record (on every rank).

        Raises:
            CheckpointError: on every rank, with the one-line reason of the rank that failed.
        """
        return strategy.save_state(self, step, rdv, optimizer, state)

    def save_on_rank0(self, step: int, rdv: Gang, state: Callable[[], Dict[str, Any]]) -> Path:
        """Rank 0 writes ``state()`` as the checkpoint of ``step`` (:meth:`write`); every rank
        waits for it (one broadcast) and raises the same one-line :class:`CheckpointError` if it
        failed, so no rank hangs in a later collective and the console shows one reason.

        With :attr:`asynchronous`, rank 0 first waits for its previous background write (its
        error is raised here, on every rank), then stages ``state()`` to CPU memory and writes
        it in the background (:meth:`finish` waits for it); the returned path is then the one
        being written."""
        path, error = None, self.drain()
        if rdv.world.rank == 0:
            try:
                if error:
                    pass  # the previous write failed: no new one
                elif self.asynchronous:
                    path = str(self._write_in_background(state(), step))
                else:
                    path = str(self.write(state(), step))
            except CheckpointError as exc:
                error = str(exc)
        elif error:  # the writer of a world before a re-form: its rank 0 does not know
            log.error("%s", error)
        path, error = rdv.broadcast_object((path, error))
        if error or path is None:
            raise CheckpointError(error or f"rank 0 wrote no checkpoint of step {step}")
        return Path(path)

    def _write_in_background(self, state: Dict[str, Any], step: int) -> Path:
        """Stage ``state`` and start its :meth:`write` in a :class:`BackgroundWrite`.

        Raises:
            CheckpointError: the CPU copy does not fit in memory.
        """
        self._stager = self._stager or Stager()
        try:
            staged = self._stager.stage(state)
        except (RuntimeError, MemoryError) as exc:
            self._stager = None  # its buffers may be half made: freed
            raise CheckpointError(_no_cpu_copy(f"the checkpoint of step {step}", exc)) from None

        def write() -> Path:
            staged.wait_ready()
            return self.write(staged.state, step)

        self._pending = BackgroundWrite(step, write)
        return self.path(step)

    @property
    def pending(self) -> Optional[BackgroundWrite]:
        """The background write of this process not waited for yet, or None."""
        return self._pending

    def drain(self) -> Optional[str]:
        """Wait for this process's background write, if any (local: no collective); returns
        its one-line error, or None (written, or nothing pending).

        Raises:
            RankFenced: the others left this rank out while it wrote: nothing was written.
        """
        pending, self._pending = self._pending, None
        self._pending_world = None
        if pending is None:
            return None
        error = pending.wait()
        if error is None:
            log.info(
                "checkpoint of step %d written in the background in %.2fs",
                pending.step,
                pending.seconds,
            )
        return error

    def finish(self, rdv: Gang) -> None:
        """Every rank waits for its background write (a collective: one all-gather): after it
        the checkpoints saved so far are on disk. Called where a run stops (its end, a stop
        request, a non-finite loss) or reloads a checkpoint.

        Raises:
            CheckpointError: on every rank, when a background write failed (its one line).
        """
        step = None if self._pending is None else self._pending.step
        old_world = self._pending_world is not None and self._pending_world is not rdv.cpu_group
        error = self.drain()
        if self._group is not None and self._group[0] is not rdv.cpu_group:
            # the checkpoint group of a world that has re-formed: closed now (its last
            # reference), so that a peer whose write still waits in it is released at once
            self._group = None
            gc.collect()
        if error and old_world:  # a rank was lost while the sharded write ran
            log.warning(
                "the background write of the checkpoint of step %s did not finish in the world "
                "it began in (%s): abandoned; the newest checkpoint that verifies is the one "
                "reloaded",
                step,
                error,
            )
            error = None
        errors = rdv.all_gather_objects(error)
        error = next((e for e in errors if e), None)
        if error:
            raise CheckpointError(error)

    def save_sharded(
        self,
        step: int,
        rdv: Gang,
        record: Dict[str, Any],
        write_shards: Callable[[Path], Dict[str, Any]],
    ) -> Path:
        """Write the checkpoint of ``step`` sharded (a collective: EVERY rank calls it): every
        rank's ``write_shards(directory)`` writes its files into a temp directory (DCP), their
        SHA-256s are gathered into ``SHA256SUMS``, the directory is renamed into place, then
        rank 0 writes the checksummed commit record (:meth:`write`, with its retention).

        Args:
            step: the optimizer step; rdv: the joined rendezvous.
            record: everything but the tensors (rank 0's is written).
            write_shards: writes this rank's shards into the directory it is given; returns
                the record's entries for them (the same on every rank).

        Raises:
            CheckpointError: on every rank, when any rank could not write (disk full or
                read-only: named with its mount point; permissions); nothing of this write is
                left (no temp or unreferenced shard directory) and earlier checkpoints are kept.
        """
        from torch.distributed.checkpoint.api import CheckpointException

        rank = rdv.world.rank
        folder = self.directory
        check_write(folder)  # a left-out rank writes no shard: it stops here (RankFenced)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        name = shard_dir_name(step, rdv.broadcast_object(secrets.token_hex(8) if rank == 0 else ""))
        tmp = folder / f".{name}.tmp"
        error, problem, digests, entries = None, None, {}, {}
        try:
            entries = write_shards(tmp)
            digests = {p.name: sha256_file(p) for p in rank_files(tmp, rank)}
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException, any rank
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            # torch's serializer loses the errno: ask the filesystem before the tmp is removed
            problem = write_problem(exc, folder) or filesystem_problem(folder)
        return self._commit_shards(step, rdv, name, record, entries, (digests, error, problem))

    def _commit_shards(
        self,
        step: int,
        gang: Gang,
        name: str,
        record: Dict[str, Any],
        entries: Dict[str, Any],
        mine: Tuple[Dict[str, str], Optional[str], Optional[str]],
    ) -> Path:
        """The end of a sharded save (a collective over ``gang``): every rank's ``mine``
        (``(digests of its files, its error, a full or read-only filesystem found)``) gathered;
        rank 0 writes ``SHA256SUMS``, renames the temp directory ``.<name>.tmp`` into place and
        writes the record, or removes what this write left; one broadcast gives every rank the
        record's path or the one-line error.

        Raises:
            CheckpointError: on every rank, with rank 0's one line.
        """
        folder = self.directory
        tmp, final = folder / f".{name}.tmp", folder / name
        gathered = gang.all_gather_objects(mine)
        failed = next((e for _, e, _ in gathered if e), None)
        problem = next((p for _, _, p in gathered if p), None)
        path, error, renamed = None, None, False
        if gang.world.rank == 0:
            try:
                if failed:
                    raise OSError(failed)
                manifest = {k: v for d, _, _ in gathered for k, v in d.items()}
                manifest[METADATA] = sha256_file(tmp / METADATA)
                record = dict(
                    record,
                    **entries,
                    shards={
                        "dir": name,
                        "manifest_sha256": write_manifest(tmp, manifest),
                        "world_size": gang.world.world_size,
                    },
                )
                check_write(final, ask=False)
                os.replace(tmp, final)
                renamed = True
                _fsync_dir(folder)
                path = self.write(record, step)
                sweep_orphans(folder, self.referenced_shard_dirs())
            except (OSError, CheckpointError) as exc:
                if path is None:  # no record names the shards: nothing of this write is kept
                    shutil.rmtree(final if renamed else tmp, ignore_errors=True)
                if isinstance(exc, CheckpointError):
                    error = str(exc)
                elif problem or write_problem(exc, folder):  # full or read-only: named
                    error = str(self.write_error(self.path(step), exc, problem=problem))
                else:
                    error = (
                        f"could not write sharded checkpoint {str(final)!r} ({exc}; earlier "
                        "checkpoints are kept): free disk space or fix permissions, then "
                        f"continue with hetseq-hpc hydra.run.dir={self.run_dir} "
                        "trainer.resume=auto"
                    )
        sent = (None if path is None else str(path), error)
        written, error = gang.broadcast_object(sent)
        if error or written is None:
            raise CheckpointError(error or f"rank 0 wrote no checkpoint of step {step}")
        return Path(written)

    def save_sharded_in_background(
        self,
        step: int,
        rdv: Gang,
        record: Dict[str, Any],
        shards: Dict[str, Any],
        entries: Dict[str, Any],
    ) -> Path:
        """:meth:`save_sharded` with ``trainer.checkpoint_async`` (a collective: EVERY rank
        calls it). On the training thread: the previous background write waited for (its
        error raised here, on every rank), this rank's ``shards`` staged to CPU memory
        (:class:`~hetseq_hpc.train.checkpoint.background.ShardStager`) and one all-gather of
        the outcomes and the directory's token. In a :class:`BackgroundWrite`: DCP writes the
        staged shards, and :meth:`_commit_shards` checks, renames and commits them; every
        collective of it runs over a gloo group of its own (:meth:`checkpoint_group`), never
        the training gang's. :meth:`finish` and the next save wait for it.

        Args:
            step: the optimizer step; rdv: the joined rendezvous (a real process group).
            record: everything but the tensors (rank 0's is written).
            shards: this rank's DCP state (``{"model": {fqn: DTensor}, "optim": ...}``).
            entries: the record's entries for the shards (the same on every rank).

        Returns:
            The path of the record being written (on every rank).

        Raises:
            CheckpointError: on every rank: the previous background write failed, or a rank
                could not copy its shards to CPU memory (nothing is written then).
            RankFenced: this rank was left out (nothing is written by it).
        """
        import torch.distributed.checkpoint as dcp

        rank = rdv.world.rank
        folder = self.directory
        drained = self.drain()  # before staging: that write reads the staged buffers
        check_write(folder)  # a left-out rank writes no shard: it stops here (RankFenced)
        staged, failed = None, drained
        if not failed:
            self._shard_stager = self._shard_stager or ShardStager()
            try:
                staged = self._shard_stager.stage(shards)
            except (RuntimeError, MemoryError) as exc:
                self._shard_stager = None  # its buffers may be half made: freed
                failed = _no_cpu_copy(f"the shards of the checkpoint of step {step}", exc)
        token = secrets.token_hex(8) if rank == 0 else ""
        gathered = rdv.all_gather_objects((failed, token))
        error = next((e for e, _ in gathered if e), None)
        if error or staged is None:
            raise CheckpointError(error or f"rank {rank} staged no shards of step {step}")
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        name = shard_dir_name(step, gathered[0][1])
        gang = Rendezvous(world=rdv.world, cpu_group=self.checkpoint_group(rdv))
        record = copy.deepcopy(record)  # the write reads it after training went on

        def write() -> Path:
            from torch.distributed.checkpoint.api import CheckpointException

            tmp = folder / f".{name}.tmp"
            error, problem, digests = None, None, {}
            try:
                check_write(tmp)  # the write fence, asked again now that it writes
                dcp.save(
                    staged,
                    storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, thread_count=1),
                    process_group=gang.cpu_group,
                )
                digests = {p.name: sha256_file(p) for p in rank_files(tmp, rank)}
            except RankFenced:
                raise
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                problem = write_problem(exc, folder) or filesystem_problem(folder)
            return self._commit_shards(step, gang, name, record, entries, (digests, error, problem))

        self._pending = BackgroundWrite(step, write)
        self._pending_world = rdv.cpu_group
        return self.path(step)

    def checkpoint_group(self, rdv: Gang) -> dist.ProcessGroup:
        """The gloo group of this world's background sharded writes (DCP's planning, the
        digests, the commit), made on first use by every rank of the world (``new_group``,
        a collective of the default group) and made anew in a re-formed world (a new
        ``rdv.cpu_group``). Its collectives wait ``timeout_s``."""
        if self._group is None or self._group[0] is not rdv.cpu_group:
            self._group = None  # the old world's: destroyed with it
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            self._group = (rdv.cpu_group, group)
        return self._group[1]

    # ------------------------------------------------------------------ choosing, loading
    def choose(self, resume: str, log_other_runs: bool = True) -> ResumeChoice:
        """Resolve ``trainer.resume``: ``never`` = start over; ``auto`` = the newest checkpoint
        of the run directory that verifies and belongs to its current run (``run.json``; bad
        newer ones are skipped and left in place, another run's are never resumed: logged as a
        warning unless ``log_other_runs`` is false, and listed in ``others`` when an older one
        is taken); anything else = that path, which must verify.

        Raises:
            CheckpointError: an explicit path is bad, or under ``auto`` no checkpoint verifies
                (the newest one's reason is given).
        """
        if resume == "never":
            return ResumeChoice()
        if resume != "auto":
            path = Path(os.path.expanduser(resume))
            return ResumeChoice(path, load_checkpoint(path))
        skipped: List[Tuple[Path, str]] = []
        others: List[Tuple[Path, str]] = []
        current = current_run_id(self.run_dir)
        for path in reversed(self.list()):
            try:
                state = load_checkpoint(path)
            except CheckpointError as exc:
                skipped.append((path, str(exc)))
                continue
            owner = state.get("run_id")
            if current and isinstance(owner, str) and owner and owner != current:
                why = (
                    f"{path} was written by run {owner}, not by this directory's current run "
                    f"{current} ({self.run_dir.run_file})"
                )
                if log_other_runs:
                    log.warning("resume: %s: not resumed", why)
                others.append((path, f"{why}: not taken"))
                continue
            return ResumeChoice(path, state, skipped, others)
        if skipped:
            raise CheckpointError(skipped[0][1])
        return ResumeChoice()

    def sweep_temps(self) -> List[Path]:
        """Remove temp files of killed checkpoint writes and shard directories no record names
        (rank 0, under the run lock, at the start of a run); returns what was removed."""
        return remove_stale_temps([self.directory]) + self.sweep_orphan_shards()

    def load(
        self, resume: str, rdv: Gang
    ) -> Tuple[Optional[str], Optional[Dict[str, Any]], List[str]]:
        """Every rank's view of ``trainer.resume``, decided once (a collective).

        Rank 0 (under the run lock) removes temp files of killed checkpoint writes
        (:meth:`sweep_temps`) and runs :meth:`choose`; one broadcast over ``rdv`` gives every
        rank the path or the error, and the other ranks load (and verify) that same file. A
        fallback past bad newer checkpoints is logged on rank 0 in one line naming them.

        Returns:
            ``(path or None, loaded state or None, bad newer checkpoints skipped)``.

        Raises:
            CheckpointError: on every rank, with rank 0's one-line reason.
        """
        choice, error = ResumeChoice(), None
        if rdv.world.rank == 0:
            swept = self.sweep_temps()
            if swept:
                log.info("removed temporary files of interrupted checkpoint writes: %s", swept)
            try:
                choice = self.choose(resume)
            except CheckpointError as exc:
                error = str(exc)
            if choice.skipped:
                _, why = choice.skipped[0]
                log.warning(
                    "resume: %s; resuming from %s instead (the bad file is kept: the next "
                    "checkpoint moves it to checkpoints/corrupt/)",
                    why.rsplit(": ", 1)[0],
                    choice.path,
                )  # every reason ends ": <fix>"
        path, skipped, error = rdv.broadcast_object(
            (
                None if choice.path is None else str(choice.path),
                [str(p) for p, _ in choice.skipped],
                error,
            )
        )
        if error:
            raise CheckpointError(error)
        if path is None:
            return None, None, []
        # rank 0 has verified every file; the others check the record, shard list and metadata
        return (
            path,
            choice.state
            if rdv.world.rank == 0
            else load_checkpoint(Path(path), verify_shards=False),
            skipped,
        )

    def agree_on_run(self, state: Optional[Dict[str, Any]], rdv: Gang) -> str:
        """Every rank's id of the current run, decided once on rank 0 (under the run lock) by
        :func:`hetseq_hpc.rundir.history.start_or_continue`: a resumed checkpoint's run goes
        on; a run starting at step 0 is new, and an earlier run's records in the directory are
        moved to ``previous/<its id>/`` first.

        Args:
            state: the checkpoint being resumed (any rank's copy), or None for step 0.
            rdv: the joined rendezvous.

        Raises:
            CheckpointError: on every rank, when the earlier run's records cannot be moved.
        """
        run_id, error = None, None
        if rdv.world.rank == 0:
            resumed = None if state is None else str(state.get("run_id") or "")
            try:
                run_id, _ = start_or_continue(self.run_dir, resumed)
            except CheckpointError as exc:
                error = str(exc)
        run_id, error = rdv.broadcast_object((run_id, error))
        if error or run_id is None:
            raise CheckpointError(error or "rank 0 chose no run id")
        return run_id

    # ------------------------------------------------------------------ retention, quarantine
    def quarantine(self, path: Path, keep_shards: Collection[str] = ()) -> Path:
        """Move a bad checkpoint and its sidecar (and its step's shard directories, but those
        named in ``keep_shards``) to ``checkpoints/corrupt/`` (never deleted); returns the new
        path."""
        target_dir = Path(path).parent / CORRUPT_DIR
        check_write(target_dir)
        target_dir.mkdir(exist_ok=True)
        target = target_dir / Path(path).name
        n = 1
        while target.exists():
            n += 1
            target = target_dir / f"{Path(path).name}.{n}"
        os.replace(path, target)
        _VERIFIED.pop(str(path), None)
        sidecar = checksum_path(path)
        if sidecar.exists():
            os.replace(sidecar, target.with_name(target.name + ".sha256"))
        for shards in shard_dirs(path):  # a sharded checkpoint's tensors go with its record
            if shards.name not in keep_shards:
                os.replace(shards, target_dir / shards.name)
        return target

    def set_aside_corrupt(self, path: Path, keep_shards: Collection[str] = ()) -> Optional[Path]:
        """Before a checkpoint is written to ``path``: a checkpoint already there that does not
        verify (``trainer.resume=auto`` fell back past it and the run trained to its step
        again) is moved to ``checkpoints/corrupt/`` (:meth:`quarantine`) instead of being
        overwritten. One that verifies is left for the write to replace (the same step trained
        again).

        Args:
            path: the checkpoint about to be written; keep_shards: shard directories of the new
                checkpoint already in place (a sharded save), which stay.

        Returns:
            where the corrupt file went, or None (nothing there, or it verifies).
        """
        try:
            if not stat.S_ISREG(Path(path).stat().st_mode):
                return None
        except OSError:  # nothing there
            return None
        try:
            verified_run_id(path)
            return None
        except (CheckpointError, OSError) as exc:
            moved = self.quarantine(path, keep_shards)
            log.warning(
                "%s; moved to %s before writing the new checkpoint of its step (not overwritten)",
                str(exc).rsplit(": ", 1)[0],
                moved,
            )
            return moved

    def retain(self, written: Path, run_id: Optional[str]) -> List[Path]:
        """Keep ``written`` and the newest ``keep - 1`` older verified checkpoints of run
        ``run_id``; delete the other older ones of that run.

        Never deleted: the checkpoint just written, any checkpoint of a later step, checkpoints
        of another run (a different ``run_id``), files that do not verify (moved to
        ``checkpoints/corrupt/`` with a warning instead, whatever their step). A checkpoint
        without a run id (written before run ids existed) counts as the current run's.

        Args:
            written: the checkpoint just written (trusted: its hash was computed while writing).
            run_id: the current run's id (None: every verified checkpoint counts).

        Returns:
            The checkpoints deleted.
        """
        written_step = step_of(written)
        older: List[Path] = []
        for path in self.list():
            if path == written:
                continue
            try:
                owner = verified_run_id(path)
            except (CheckpointError, OSError) as exc:
                moved = self.quarantine(path)
                log.warning(
                    "%s; moved to %s (not counted by retention, not deleted)",
                    str(exc).rsplit(": ", 1)[0],
                    moved,
                )
                continue
            if step_of(path) > written_step or (run_id and owner and owner != run_id):
                continue  # a later step, or another run's file: not ours to delete
            older.append(path)
        doomed = older[: max(len(older) - (self.keep - 1), 0)]
        if doomed:
            check_write(written.parent, ask=False)  # a left-out rank deletes nothing either
        for path in doomed:
            for shards in shard_dirs(path):
                shutil.rmtree(shards, ignore_errors=True)
            path.unlink(missing_ok=True)
            checksum_path(path).unlink(missing_ok=True)
            _VERIFIED.pop(str(path), None)
        self.sweep_dead_writes(written_step)
        return doomed

    def sweep_dead_writes(self, written_step: int) -> List[Path]:
        """Remove what killed writers of whole checkpoints left while the run went on (an
        elastic run never restarts, so :meth:`sweep_temps` at its start never comes): temp files
        of another process (only this one writes whole checkpoints now: rank 0 of the current
        world, behind the write fence) and sidecars of steps before ``written_step`` whose
        checkpoint was never renamed into place. Sharded checkpoints' folders are left alone.
        Returns what was removed."""
        mine = f".{os.getpid()}.tmp"
        dead = [p for p in self.directory.glob(".step_*.tmp") if not p.name.endswith(mine)]
        for sidecar in self.directory.glob("step_*.pt.sha256"):
            checkpoint = sidecar.with_name(sidecar.name[: -len(".sha256")])
            try:
                older = step_of(checkpoint) < written_step
            except ValueError:
                continue
            if older and not checkpoint.exists():
                dead.append(sidecar)
        dead = [p for p in dead if p.is_file()]
        if dead:
            check_write(self.directory, ask=False)  # a left-out rank removes nothing either
        for path in dead:
            path.unlink(missing_ok=True)
        return dead


def _no_cpu_copy(what: str, exc: BaseException) -> str:
    """The one line of a background save whose CPU copy of ``what`` failed (``exc``: out of
    memory, or pinned memory refused)."""
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return (
        f"could not copy {what} to CPU memory for its background write "
        f"({type(exc).__name__}{': ' + first if first else ''}): set "
        "trainer.checkpoint_async=false to write from the training state directly"
    )


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "FORMAT_VERSION",
    "REQUIRED",
    "CheckpointManager",
    "ResumeChoice",
    "StateIO",
    "load_checkpoint",
    "require_entries",
    "verified_run_id",
]
