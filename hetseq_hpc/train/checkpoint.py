"""Checkpoints in ``<run dir>/checkpoints``: atomic, checksummed, loaded without running code.

* ``step_XXXXXXXX.pt`` is written through :func:`hetseq_hpc.files.atomic.atomic_write` (temp file,
  fsync, rename), so a crash never leaves a half-written checkpoint under its final name;
  ``.<name>.<pid>.tmp`` files of killed writers are swept at the start of the next run.
* Its SHA-256 goes to the sidecar ``step_XXXXXXXX.pt.sha256`` (``sha256sum`` format, so
  ``sha256sum -c`` checks it by hand) and is verified before the file is unpickled: flipped
  bits are named, never trained on.
* It is read with ``torch.load(weights_only=True)``: only tensors and plain containers load,
  so a crafted file cannot run code (https://pytorch.org/docs/stable/generated/torch.load.html).
  Everything hetseq_hpc stores is plain data (:mod:`hetseq_hpc.train.state`).
* A full disk (``OSError`` ENOSPC, or the ``RuntimeError`` torch's serializer raises instead)
  or a read-only one removes the temp file, keeps the earlier checkpoints and raises one line
  naming the device.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple

import torch

from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.files.atomic import atomic_write, atomic_write_text, remove_stale_temps
from hetseq_hpc.files.user_input import file_problem
from hetseq_hpc.rundir.history import current_run_id, start_or_continue
from hetseq_hpc.rundir.storage import fix_for, write_problem
from hetseq_hpc.train.checkpoint_files import FIX as _FIX
from hetseq_hpc.train.checkpoint_files import (  # noqa: F401 - re-exported: the public names
    apply_retention,
    checkpoint_dir,
    checkpoint_path,
    checksum_path,
    list_checkpoints,
    set_aside_corrupt,
    stored_run_id,
    verify_checksum,
)
from hetseq_hpc.train.shard_files import sweep_shard_temps
from hetseq_hpc.train.shard_files import verify_shards as check_shards

log = logging.getLogger(__name__)

#: bump when the checkpoint layout changes (2: checksummed, plain-data rng states, config)
FORMAT_VERSION = 2
#: entries every checkpoint must hold
REQUIRED = ("model", "optimizer", "scheduler", "step")


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


def kept_words(run_dir: Path, final: Path) -> str:
    """What is left after the checkpoint ``final`` could not be written: the newest earlier one
    (it is what ``trainer.resume=auto`` takes), or that there is none."""
    earlier = [p for p in list_checkpoints(run_dir) if p != final]
    return (
        f"the earlier checkpoint {earlier[-1].name} is kept"
        if earlier
        else "no earlier checkpoint exists"
    )


def write_error(
    final: Path, exc: BaseException, seen: Optional[OSError] = None, problem: Optional[str] = None
) -> CheckpointError:
    """One-line CheckpointError for a failed write of checkpoint ``final`` (``seen``: the first
    OSError the writer saw; ``problem``: a full or read-only filesystem found otherwise, see
    :mod:`hetseq_hpc.rundir.storage`); names the mount point when the disk is full or
    read-only."""
    run_dir = final.parent.parent
    chain, cause = [seen] if seen else [], exc
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    in_way = next((p for p in (final, checksum_path(final)) if p.is_dir()), None)
    if in_way is not None:  # a directory at the checkpoint's (or its checksum's) name
        return CheckpointError(
            f"could not write checkpoint {str(final)!r}: {str(in_way)!r} is a directory, not a "
            f"file: remove or rename it, then continue with hetseq-hpc "
            f"hydra.run.dir={run_dir} trainer.resume=auto"
        )
    kept = kept_words(run_dir, final)
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
            f"{problem} (writing checkpoint {str(final)!r}; {kept}): {fix_for(problem, run_dir)}"
        )
    reason = next((e.strerror for e in chain if getattr(e, "strerror", None)), None)
    return CheckpointError(
        f"could not write checkpoint {str(final)!r} ({reason or type(exc).__name__}; {kept}): "
        "free disk space or fix permissions"
    )


def save_checkpoint(state: Dict[str, Any], run_dir: Path, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` (plus its SHA-256 sidecar); keep the newest
    ``keep`` checkpoints. A corrupt checkpoint of the same step is moved to
    ``checkpoints/corrupt/`` first, not overwritten.

    Raises:
        CheckpointError: the file cannot be written (disk full, permissions); the temporary
            file is removed and earlier checkpoints are untouched.
    """
    final = checkpoint_path(run_dir, step)
    payload = dict(state, format_version=FORMAT_VERSION, step=step)
    box: Dict[str, _HashingWriter] = {}

    def write(fh: BinaryIO) -> None:
        box["w"] = _HashingWriter(fh)
        torch.save(payload, box["w"])

    shards = payload.get("shards")
    set_aside_corrupt(
        final, [shards["dir"]] if isinstance(shards, dict) and "dir" in shards else []
    )
    written = False
    try:
        atomic_write(final, write, durable=True)
        written = True
        digest = box["w"].sha.hexdigest()
        atomic_write_text(checksum_path(final), f"{digest}  {final.name}\n", durable=True)
    except (OSError, RuntimeError) as exc:
        if written:  # its checksum could not be written: not a usable checkpoint
            final.unlink(missing_ok=True)
        writer = box.get("w")
        raise write_error(final, exc, writer.error if writer else None) from None
    apply_retention(run_dir, final, keep, payload.get("run_id"))
    log.info("checkpoint: %s", final)
    return final


def require_entries(state: Any, source: str) -> None:
    """Raise a one-line :class:`CheckpointError` if ``state`` lacks an entry of :data:`REQUIRED`."""
    missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {source!r} has no {', '.join(missing)} entry: it is not a complete "
            "hetseq_hpc checkpoint; point trainer.resume at one this version wrote, or set "
            "trainer.resume=never"
        )


def load_checkpoint(path: Path, verify_shards: bool = True) -> Dict[str, Any]:
    """Verify and read a checkpoint onto the CPU, running no code from the file. A sharded
    checkpoint's record is returned without its tensors (its ``shards`` entry names them), after
    :func:`hetseq_hpc.train.shard_files.verify_shards` (every file's checksum when
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
            f"checkpoint {str(path)!r} is corrupt or unreadable ({type(exc).__name__}): {_FIX}"
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


def choose_checkpoint(resume: str, run_dir: Path, log_other_runs: bool = True) -> ResumeChoice:
    """Resolve ``trainer.resume``: ``never`` = start over; ``auto`` = the newest checkpoint of
    the run directory that verifies and belongs to its current run (``run.json``; bad newer
    ones are skipped and left in place, another run's are never resumed: logged as a warning
    unless ``log_other_runs`` is false, and listed in ``others`` when an older one is taken);
    anything else = that path, which must verify.

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
    current = current_run_id(run_dir)
    for path in reversed(list_checkpoints(run_dir)):
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        owner = state.get("run_id")
        if current and isinstance(owner, str) and owner and owner != current:
            why = (
                f"{path} was written by run {owner}, not by this directory's current run "
                f"{current} ({run_dir / 'run.json'})"
            )
            if log_other_runs:
                log.warning("resume: %s: not resumed", why)
            others.append((path, f"{why}: not taken"))
            continue
        return ResumeChoice(path, state, skipped, others)
    if skipped:
        raise CheckpointError(skipped[0][1])
    return ResumeChoice()


def agree_on_checkpoint(
    rdv: Any, resume: str, run_dir: Path
) -> Tuple[Optional[str], Optional[Dict[str, Any]], List[str]]:
    """Every rank's view of ``trainer.resume``, decided once.

    Rank 0 (under the run lock) removes temp files of killed checkpoint writes and runs
    :func:`choose_checkpoint`; one broadcast over ``rdv`` gives every rank the path or the
    error, and the other ranks load (and verify) that same file. A fallback past bad newer
    checkpoints is logged on rank 0 in one line naming them.

    Returns:
        ``(path or None, loaded state or None, bad newer checkpoints skipped)``.

    Raises:
        CheckpointError: on every rank, with rank 0's one-line reason.
    """
    choice, error = ResumeChoice(), None
    if rdv.world.rank == 0:
        swept = remove_stale_temps([checkpoint_dir(run_dir)]) + sweep_shard_temps(run_dir)
        if swept:
            log.info("removed temporary files of interrupted checkpoint writes: %s", swept)
        try:
            choice = choose_checkpoint(resume, run_dir)
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
        (choice.path and str(choice.path), [str(p) for p, _ in choice.skipped], error)
    )
    if error:
        raise CheckpointError(error)
    if path is None:
        return None, None, []
    # rank 0 has verified every file; the others check the record, shard list and metadata
    return (
        path,
        choice.state if rdv.world.rank == 0 else load_checkpoint(Path(path), verify_shards=False),
        skipped,
    )


def agree_on_run(rdv: Any, run_dir: Path, state: Optional[Dict[str, Any]]) -> str:
    """Every rank's id of the current run, decided once on rank 0 (under the run lock) by
    :func:`hetseq_hpc.rundir.history.start_or_continue`: a resumed checkpoint's run goes
    on; a run starting at step 0 is new, and an earlier run's records in the directory are
    moved to ``previous/<its id>/`` first.

    Args:
        rdv: the joined rendezvous.
        run_dir: the run directory.
        state: the checkpoint being resumed (any rank's copy), or None for step 0.

    Raises:
        CheckpointError: on every rank, when the earlier run's records cannot be moved.
    """
    run_id, error = None, None
    if rdv.world.rank == 0:
        resumed = None if state is None else str(state.get("run_id") or "")
        try:
            run_id, _ = start_or_continue(run_dir, resumed)
        except CheckpointError as exc:
            error = str(exc)
    run_id, error = rdv.broadcast_object((run_id, error))
    if error:
        raise CheckpointError(error)
    return run_id


def save_on_rank0(
    rdv: Any, state_fn: Callable[[], Dict[str, Any]], run_dir: Path, step: int, keep: int
) -> None:
    """Rank 0 saves ``state_fn()`` as the checkpoint of ``step``; every rank waits for it (one
    broadcast) and raises the same one-line :class:`CheckpointError` if it failed, so no rank
    hangs in a later collective and the console shows one reason."""
    error = None
    if rdv.world.rank == 0:
        try:
            save_checkpoint(state_fn(), run_dir, step, keep)
        except CheckpointError as exc:
            error = str(exc)
    error = rdv.broadcast_object(error)
    if error:
        raise CheckpointError(error)
