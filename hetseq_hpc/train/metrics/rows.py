"""``metrics.jsonl`` (one JSON object per logged step, written by rank 0) and the progress bar."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from hetseq_hpc.errors import ConfigError, HetseqError, StorageError
from hetseq_hpc.files.atomic import atomic_write_text
from hetseq_hpc.files.fence import check_write, stamp
from hetseq_hpc.files.user_input import describe, file_problem, kind_of
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.rundir.storage import storage_error
from hetseq_hpc.train.records import FoldedSteps, StepRecord

if TYPE_CHECKING:  # torch-free at import (the launcher reads metrics.jsonl)
    from hetseq_hpc.balance.agree import RankMeta
    from hetseq_hpc.balance.allocation import RankShare

log = logging.getLogger(__name__)

METRICS_NAME = RunDir.METRICS_NAME


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _records_a_stop(row: Dict[str, Any]) -> bool:
    """Whether ``row`` is the membership row of survivors that stopped (too few left,
    :mod:`hetseq_hpc.train.recovery.elastic`): its ``step`` is the step in progress when the rank was
    lost, after the checkpoint the requeued job resumes from, yet it is that job's history
    (kept on resume, or the run would lose the record of why it stopped)."""
    return row.get("event") == "membership" and bool(row.get("stopped"))


class MetricsWriter:
    """Appends rows to ``<run dir>/metrics.jsonl``, each in one ``write`` to the kernel, so a
    crash loses nothing already logged. A row is written whole or not at all: when the disk
    fills (or turns read-only) mid-row, the file is cut back to its last whole row and a
    one-line :class:`~hetseq_hpc.errors.StorageError` is raised. On resume, rows of steps
    after the checkpoint are dropped first, so the file reads as one uninterrupted run (a
    membership row that records a stop is kept: :func:`_records_a_stop`).

    ``keep_membership``: a writer opened inside the running job (a new rank 0 after a
    recovery or a join) keeps every membership row: the job's own history, never redone,
    whose ``step`` (the step in progress at a loss) may be after ``resume_step`` (the step an
    FSDP world reloaded; a replacement may join right after the first step redone)."""

    def __init__(self, path: Path, resume_step: int = 0, keep_membership: bool = False):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._truncate_after(resume_step, keep_membership)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._error(exc) or exc from None

    def _error(self, exc: BaseException) -> Optional[StorageError]:
        return storage_error(self.path.parent, exc, self.path)

    def _truncate_after(self, step: int, keep_membership: bool) -> None:
        # drops cut-off, damaged and non-row lines: what a resumed run appends must read back
        keep = [
            line
            for _, line, row in _parse(self.path, strict=False)
            if isinstance(row, dict)
            and isinstance(row.get("step", 0), int)
            and (
                row.get("step", 0) <= step
                or _records_a_stop(row)
                or (keep_membership and row.get("event") == "membership")
            )
        ]
        atomic_write_text(self.path, "".join(line + "\n" for line in keep))

    def write(self, row: Dict[str, Any]) -> None:
        """Append one row, whole or not at all.

        Raises:
            StorageError: the filesystem is full or read-only (the file keeps its whole rows).
            OSError: any other failed write (the file keeps its whole rows).
            RankFenced: the others went on without this rank (:mod:`hetseq_hpc.files.fence`;
                nothing is written; a row written carries its writer's ``written_by``).
        """
        check_write(self.path)
        row = {**row, **stamp()}
        data = memoryview((json.dumps(_clean(row), sort_keys=False) + "\n").encode("utf-8"))
        start = os.fstat(self._fd).st_size
        done = 0
        try:
            while done < len(data):  # a short write (the disk filled mid-row) is followed up
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            with contextlib.suppress(OSError):  # the part of the row that was written
                os.ftruncate(self._fd, start)
            raise self._error(exc) or exc from None

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


def _parse(path: Path, strict: bool) -> Iterator[Tuple[int, str, Optional[Dict[str, Any]]]]:
    """``(line number, line, row or None)`` of every non-empty line; with ``strict`` a line
    that is not JSON raises, unless it is the last one (a row still being written), and bytes
    that are not UTF-8 raise ``UnicodeDecodeError``; without it both become ``None`` rows."""
    lines = path.read_text(encoding="utf-8", errors="strict" if strict else "replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, line, json.loads(line)
        except (ValueError, RecursionError) as exc:
            if strict and isinstance(exc, RecursionError):
                raise  # read_metrics names it
            if strict and number < len(lines):
                raise HetseqError(
                    f"{path} line {number} is not JSON: the run may have been cut "
                    "off mid-write; delete that line"
                ) from None
            yield number, line, None


def read_metrics(run_dir: Union[str, Path]) -> List[Dict[str, Any]]:
    """All rows of a run's ``metrics.jsonl`` (``run_dir`` may also be the file itself); a last
    line still being written is skipped. The file kind is checked before it is opened (a FIFO
    or a device is refused, never read).

    Raises:
        ConfigError (a :class:`HetseqError`): ``run_dir`` is neither a run directory nor a
            ``.jsonl`` file, the file is missing or not a regular file, is not UTF-8 text, a
            line before the last is not JSON, or a row is not a JSON object (one line naming
            the file and line).
    """
    given = Path(run_dir)
    fix = f"pass the run directory of a hetseq_hpc run (it writes {METRICS_NAME})"
    path = given if given.name.endswith(".jsonl") and not given.is_dir() else given / METRICS_NAME
    if path != given and kind_of(given) not in (None, "a directory"):
        raise ConfigError(f"{given} is not a run directory (it is {kind_of(given)}): {fix}")
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"{path} {problem}: {fix}")
    try:
        parsed = list(_parse(path, strict=True))
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} line {line} is not UTF-8 text (binary data?): restore the file "
            "a hetseq_hpc run wrote, or delete that line"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{path} has a row nested too deeply to be read: restore the file a "
            "hetseq_hpc run wrote, or delete that row"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}): {fix}") from None
    except HetseqError as exc:  # a damaged line before the last (_parse)
        raise ConfigError(str(exc)) from None
    for number, _, row in parsed:
        if row is not None and not isinstance(row, dict):
            raise ConfigError(
                f"{path} line {number} is {describe(row)}, not a JSON object: "
                "restore the file a hetseq_hpc run wrote, or delete that line"
            )
    return [row for _, _, row in parsed if row is not None]


def step_row(
    rec: StepRecord,
    metas: Sequence[RankMeta],
    shares: Sequence[RankShare],
    global_batch_size: int,
    tokens_per_sample: float,
    allocation: List[int],
    units_per_sample: Optional[float] = None,
) -> Dict[str, Any]:
    """The ``metrics.jsonl`` row of step record ``rec`` (:class:`~hetseq_hpc.train.records.StepRecord`):
    global figures plus one entry per rank (its :class:`~hetseq_hpc.train.records.RankMeta`,
    :class:`~hetseq_hpc.balance.allocation.RankShare` and :class:`~hetseq_hpc.distributed.rendezvous.StepStats`)."""
    samples_per_s = global_batch_size / max(rec.wall_s, 1e-9)
    ranks: List[Dict[str, Any]] = [
        {
            "rank": meta.rank,
            "device": meta.device,
            "node": meta.node,
            "het_group": meta.het_group,
            "partition": meta.partition,
            "gres": meta.gres,
            "precision": getattr(meta, "precision", None),
            "micro_batch": share.micro_batch,
            "accum_steps": share.accum_steps,
            "samples": int(stats.samples),
            "step_time_s": round(stats.step_time_s, 6),
            "compute_time_s": round(stats.compute_time_s, 6),
            "data_time_s": round(stats.data_time_s, 6),
            "tail_time_s": round(stats.tail_time_s, 6),
        }
        for meta, stats, share in zip(metas, rec.per_rank, shares)
    ]
    compute = [r["compute_time_s"] for r in ranks]
    mean = sum(compute) / len(compute)
    return {
        "step": rec.step,
        "time": time.time(),
        "epoch": rec.epoch,
        "loss": rec.loss,
        "lr": rec.lr,
        "grad_norm": rec.grad_norm,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * tokens_per_sample,
        "step_time_s": rec.wall_s,
        # the task's loss units per second (masked tokens, images, target tokens ...)
        "units_per_s": samples_per_s
        * (tokens_per_sample if units_per_sample is None else units_per_sample),
        "straggle": (max(compute) - min(compute)) / mean if mean > 0 else 0.0,
        "allocation": allocation,
        "ranks": ranks,
        # loss scale / skipped step / payload bytes (train.precision.GradientPath.row)
        **getattr(rec, "grad_path", {}),
    }


#: steps of a fit left out of its steady-state rate (``steady_samples_per_s``)
WARMUP_STEPS = 3


def run_summary(
    history: Sequence[StepRecord],
    metas: Sequence[RankMeta],
    global_batch_size: int,
    step: int,
    validation: Optional[Dict[str, float]],
    allocation: List[int],
) -> Dict[str, Any]:
    """A run's final figures from its step records (``history``, this run's steps only; a
    :class:`~hetseq_hpc.train.records.StepHistory` adds the steps it folded): first and final
    loss, ``validation``, throughput, and each rank's measured samples per compute second
    (what a re-balance or the next allocation would use)."""
    folded = getattr(history, "folded", None) or FoldedSteps()
    held = list(history)
    per_rank = []
    for r, meta in enumerate(metas):
        # a world that grew back (trainer.elastic.restarts) had fewer ranks for a while
        mine = [rec.per_rank[r] for rec in held if r < len(rec.per_rank)]
        samples = float(sum(stats.samples for stats in mine))
        compute = sum(stats.compute_time_s for stats in mine)
        if r < len(folded.samples):
            samples += folded.samples[r]
            compute += folded.compute_s[r]
        per_rank.append(
            {
                "rank": r,
                "device": meta.device,
                "partition": meta.partition,
                "samples": int(samples),
                "samples_per_compute_s": samples / compute if compute > 0 else None,
            }
        )
    steps = folded.count + len(held)
    walls = folded.walls + [rec.wall_s for rec in held]
    wall = folded.wall_s + sum(rec.wall_s for rec in held)
    # steady state: the median step after the warm-up (first shapes, allocator, caches)
    settled = walls[WARMUP_STEPS:] if steps > WARMUP_STEPS else walls[1:]
    steady = [global_batch_size / w for w in settled if w > 0]
    first = folded.first_loss if folded.count else (held[0].loss if held else None)
    return {
        "steps_run": steps,
        "final_step": held[-1].step if held else step,
        "final_loss": held[-1].loss if held else None,
        "first_loss": first,
        "validation": validation,
        # over the training steps only (validation and checkpoints left out)
        "samples_per_s": steps * global_batch_size / wall if wall > 0 else None,
        "steady_samples_per_s": statistics.median(steady) if steady else None,
        "steady_after_steps": WARMUP_STEPS if steps > WARMUP_STEPS else 1,
        "allocation": allocation,
        "ranks": per_rank,
    }


def measured_step_sync(
    history: Sequence[StepRecord], samples: List[int], min_steps: int = 3
) -> Optional[Dict[str, Any]]:
    """What a step cost beyond the ranks' own work, measured over the steps run with the split
    ``samples`` (the first step after a switch to it left out: new shapes warm up).

    A step's wall time is the time between two consecutive step ends on this rank
    (``StepRecord.ended_s``); rank ``i``'s busy time is its ``compute_time_s + tail_time_s``
    (forward+backward until its last gradient bucket was ready, plus its local work between
    steps). ``sync_s = median(wall) - max_i median(busy_i)`` (>= 0) is what the cost model's
    ``max_i T_i`` leaves out: the all-reduce not hidden behind the slowest rank's backward, the
    step-statistics exchange, and the straggling of ranks whose step times jitter (the median of
    a maximum exceeds the maximum of medians). The planner adds it to its predicted step
    (:func:`hetseq_hpc.plan.step_time.predict`). Seconds; None with fewer than ``min_steps``
    such steps.
    """
    walls, busy = [], []
    for prev, rec in itertools.pairwise(history):
        if (
            [s.samples for s in prev.per_rank] != list(samples)
            or [s.samples for s in rec.per_rank] != list(samples)
            or not prev.ended_s
        ):
            continue
        walls.append(rec.ended_s - prev.ended_s)
        busy.append([s.compute_time_s + getattr(s, "tail_time_s", 0.0) for s in rec.per_rank])
    if len(walls) < min_steps:
        return None
    busy_s = [statistics.median(row[i] for row in busy) for i in range(len(samples))]
    step_s = statistics.median(walls)
    return {
        "steps": len(walls),
        "samples": list(samples),
        "step_s": round(step_s, 6),
        "busy_s": [round(b, 6) for b in busy_s],
        "sync_s": round(max(0.0, step_s - max(busy_s)), 6),
    }


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, else a log line every ``every`` steps."""

    def __init__(self, total: int, initial: int, enabled: bool, every: int = 10):
        self.enabled = enabled
        self.every = every
        self.total = total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(
        self, step: int, loss: float, samples_per_s: float, extra: Optional[str] = None
    ) -> None:
        """Report step ``step``."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.1f}")
        elif step % self.every == 0 or step == self.total or step == 1:
            log.info(
                "step %d/%d loss %.4f %.1f samples/s%s",
                step,
                self.total,
                loss,
                samples_per_s,
                f" {extra}" if extra else "",
            )

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()
