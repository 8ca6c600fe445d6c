"""Checkpoint writes off the training thread (``trainer.checkpoint_async``).

* :class:`Stager` copies a checkpoint's state into CPU memory that training cannot change
  afterwards (pinned when a tensor is on CUDA: the copies are queued on the current stream and
  waited for by the writer, not by the training thread); the buffers are kept and reused by
  the next save, so a save costs one memory copy, not an allocation.
* :class:`ShardStager` does the same for a sharded (FSDP) checkpoint's DCP state: this rank's
  local shards (DTensors) copied with DCP's own staging copy, the buffers kept while the shard
  layout stays.
* :class:`BackgroundWrite` runs one write in a daemon thread and keeps its one-line error for
  whoever waits for it: the next save, or the run's exit (a kill leaves the temp file, never a
  half checkpoint: the previous one is what a resume takes).
* :data:`HOLD_ENV` is a TEST-ONLY hook (:func:`hold_for_tests`): it holds a write before its
  rename, so that a test can kill a run while a checkpoint is being written.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from hetseq_hpc.balance.memory import local_part
from hetseq_hpc.errors import CheckpointError, RankFenced

#: TEST-ONLY: a folder; the write of step S holds before its rename while ``<it>/hold_S``
#: exists, after creating ``<it>/held_S``, until ``<it>/release_S`` exists
HOLD_ENV = "HETSEQ_TEST_HOLD_CHECKPOINT"


def hold_for_tests(step: int) -> None:
    """TEST-ONLY (:data:`HOLD_ENV`; nothing happens when it is unset): hold the write of
    ``step`` before its rename while a test looks at the run (polls every 20 ms).

    ``hold_S`` holding the word ``once`` is removed as the hold starts (a later write of the
    same step, after a reload, is not held). ``kill_S`` holding a pid: that process is sent
    SIGKILL as the hold starts (then the file is removed): a fault at a known point of the
    write, not at a test's poll (the pid may be this process: the writer lost mid-write)."""
    folder = os.environ.get(HOLD_ENV)
    hold = Path(folder) / f"hold_{step}" if folder else None
    if hold is None or not hold.exists():
        return
    if hold.read_text().strip() == "once":
        hold.unlink(missing_ok=True)
    (hold.parent / f"held_{step}").touch()
    victim = hold.parent / f"kill_{step}"
    if victim.exists():
        pid = int(victim.read_text())
        victim.unlink()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while not (hold.parent / f"release_{step}").exists():
        time.sleep(0.02)


@dataclass
class Staged:
    """A checkpoint's state in CPU memory of its own.

    Attributes:
        state: the state, every tensor a CPU copy (the same nesting, non-tensors deep-copied).
        ready: a CUDA event after the last device-to-host copy, or None (CPU tensors only).
        nbytes: bytes of the tensors copied.
    """

    state: Dict[str, Any]
    ready: Optional[Any] = None
    nbytes: int = 0

    def wait_ready(self) -> None:
        """Wait until the copies from the device are done (the writer calls it)."""
        if self.ready is not None:
            self.ready.synchronize()


class Stager:
    """Copies checkpoint states to CPU buffers it keeps between saves (same place, shape and
    dtype: reused). A tensor shared by two entries (tied weights) is copied once and stays
    shared. The caller must not stage again while a write still reads the last copy."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[Any, ...], torch.Tensor] = {}

    def stage(self, state: Dict[str, Any]) -> Staged:
        """Copy ``state`` (nested dicts, lists and tuples of tensors and plain data).

        Raises:
            RuntimeError: the copy does not fit in (pinned) CPU memory.
        """
        memo: Dict[Tuple[Any, ...], torch.Tensor] = {}
        info = {"cuda": False, "nbytes": 0}
        threads = torch.get_num_threads()
        # one thread per copy: a multi-threaded memcpy waits for every thread, and on a loaded
        # host one descheduled thread made it 4-20x slower (scripts/bench_checkpoint.py)
        torch.set_num_threads(1)
        try:
            staged = self._copy(state, (), memo, info)
        finally:
            torch.set_num_threads(threads)
        ready = None
        if info["cuda"]:
            ready = torch.cuda.Event()
            ready.record()
        return Staged(staged, ready, int(info["nbytes"]))

    def _copy(self, value: Any, where: Tuple[Any, ...], memo: dict, info: dict) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where, memo, info)
        if isinstance(value, dict):
            return {k: self._copy(v, (*where, k), memo, info) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._copy(v, (*where, i), memo, info) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, t: torch.Tensor, where: Tuple[Any, ...], memo: dict, info: dict) -> Any:
        t = t.detach()
        storage = (t.device, t.untyped_storage().data_ptr(), t.storage_offset())
        key = (*storage, t.shape, t.stride(), t.dtype)
        if key in memo:
            return memo[key]
        cuda = t.device.type == "cuda"
        buf = self._buffers.get(where)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
            self._buffers[where] = buf
        buf.copy_(t, non_blocking=cuda)
        info["cuda"] = info["cuda"] or cuda
        info["nbytes"] += buf.numel() * buf.element_size()
        memo[key] = buf
        return buf


def shard_layout(state: Any) -> Tuple[Any, ...]:
    """What a staged copy of a DCP state depends on: every entry's path, local shape, dtype
    and device type (a DTensor by its local shard), in order."""
    out: list = []

    def walk(value: Any, where: Tuple[Any, ...]) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*where, key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, (*where, i))
        elif isinstance(value, torch.Tensor):
            local = local_part(value)  # a DTensor's local shard
            out.append((where, tuple(local.shape), local.dtype, local.device.type))
        else:
            out.append((where, type(value).__name__))

    walk(state, ())
    return tuple(out)


class ShardStager:
    """Copies this rank's DCP state (``{"model": {fqn: DTensor}, "optim": {...}}``) into CPU
    buffers with DCP's staging copy (``_create_cpu_state_dict`` / ``_copy_state_dict``, what
    ``BlockingAsyncStager`` runs), pinned when a tensor is on CUDA. The buffers are kept and
    reused while :func:`shard_layout` stays the same (a re-formed world's shards differ: new
    buffers). The caller must not stage again while a write still reads the last copy."""

    def __init__(self) -> None:
        self._layout: Optional[Tuple[Any, ...]] = None
        self._buffers: Optional[Dict[str, Any]] = None

    def stage(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """A CPU copy of ``state`` that training cannot change (blocks until it is copied).

        Raises:
            RuntimeError: the copy does not fit in (pinned) CPU memory.
        """
        # DCP's staging copy, imported here: torch.distributed's state-dict and tensor modules
        # pull in sympy, which a replicated run's worker never needs
        # (tests/integration/test_bert_native_imports.py)
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = shard_layout(state)
        if self._buffers is None or layout != self._layout:
            self._buffers, self._layout = None, None  # the old copy freed before the new one
            cuda = any(entry[-1] == "cuda" for entry in layout if len(entry) == 4)
            self._buffers = _create_cpu_state_dict(state, pin_memory=cuda)
            self._layout = layout
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as Stager.stage: one thread per copy on a loaded host
        try:
            return _copy_state_dict(state, self._buffers, type_check=False)
        finally:
            torch.set_num_threads(threads)


class BackgroundWrite:
    """One checkpoint write in a daemon thread.

    Args:
        step: the optimizer step written.
        write: does the write; returns the checkpoint's path; raises CheckpointError (one
            line) when it fails. Any other exception is turned into one line too, but a
            ``RankFenced`` (this rank may not write: :mod:`hetseq_hpc.files.fence`), kept in
            :attr:`fenced` for the waiter to raise.
    """

    def __init__(self, step: int, write: Callable[[], Path]):
        self.step = step
        #: set once someone waits for the write (the next save, the exit)
        self.waited = threading.Event()
        self.path: Optional[Path] = None
        self.error: Optional[str] = None
        self.fenced: Optional[RankFenced] = None
        self.seconds = 0.0
        self._write = write
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self.path = self._write()
        except CheckpointError as exc:
            self.error = str(exc)
        except RankFenced as exc:  # not a failed write: the rank stops (its waiter raises it)
            self.fenced = exc
        except BaseException as exc:  # never lost in the thread
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.error = (
                f"could not write the checkpoint of step {self.step} in the background "
                f"({type(exc).__name__}{': ' + first[:200] if first else ''}; earlier "
                "checkpoints are kept): set trainer.checkpoint_async=false to write it on the "
                "training thread"
            )
        finally:
            self.seconds = time.perf_counter() - start

    def done(self) -> bool:
        """Whether the write has ended (written or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> Optional[str]:
        """Wait for the write to end; returns its one-line error, or None when it was written.

        Raises:
            RankFenced: this rank was not allowed to write it (nothing was written).
        """
        self.waited.set()
        self._thread.join()
        if self.fenced is not None:
            raise self.fenced
        return self.error


__all__ = [
    "HOLD_ENV",
    "BackgroundWrite",
    "ShardStager",
    "Staged",
    "Stager",
    "hold_for_tests",
    "shard_layout",
]
