"""Where rank 0's step rows go: ``metrics.jsonl`` always, plus CSV, TensorBoard and W&B.

``trainer.loggers=[jsonl,csv,tensorboard,wandb]`` picks them; every logger gets the same row and
keeps one record per step. An optional logger that cannot open or write gives ONE warning and
is dropped (metrics never stop a run); a resume drops the steps after the checkpoint from every
logger. What each writes: docs/design/metrics.md.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.config.trainer import LOGGER_NAMES
from hetseq_hpc.files.atomic import atomic_write_text
from hetseq_hpc.files.fence import check_write
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.train.metrics.rows import METRICS_NAME, MetricsWriter, _clean, read_metrics

log = logging.getLogger(__name__)

CSV_NAME = RunDir.CSV_NAME
TB_DIR = RunDir.TB_NAME
#: global scalars of a row -> TensorBoard tag
TB_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "samples_per_s": "train/samples_per_s",
    "tokens_per_s": "train/tokens_per_s",
    "grad_norm": "train/grad_norm",
    "straggle": "train/straggle",
    "step_time_s": "train/step_time_s",
    "val_loss": "val/loss",
    "val_ppl": "val/ppl",
}
#: per-rank fields -> TensorBoard tag prefix (one curve per rank)
TB_RANK_FIELDS = {
    "step_time_s": "rank_step_time_s",
    "compute_time_s": "rank_compute_time_s",
    "micro_batch": "rank_micro_batch",
    "samples": "rank_samples",
}
#: per-rank fields copied into CSV columns ``rank<N>_<field>``
CSV_RANK_FIELDS = (
    "micro_batch",
    "accum_steps",
    "samples",
    "step_time_s",
    "compute_time_s",
    "data_time_s",
)


def missing_logger_package(name: str) -> Optional[str]:
    """The package ``trainer.loggers`` entry ``name`` needs but cannot import, else None."""
    needs = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(name)
    if needs and importlib.util.find_spec(needs) is None:
        return needs
    return None


def flat_row(row: Dict[str, Any]) -> Dict[str, Any]:
    """A step row as flat CSV fields: scalars as they are, per-rank figures as
    ``rank<N>_<field>``, the allocation as ``a/b/c``, a re-allocation as ``from -> to``."""
    out: Dict[str, Any] = {}
    for key, value in row.items():
        if key == "ranks":
            for rank in value or []:
                for name in CSV_RANK_FIELDS:
                    if name in rank:
                        out[f"rank{rank['rank']}_{name}"] = rank[name]
        elif key == "allocation" and isinstance(value, list):
            out[key] = "/".join(str(v) for v in value)
        elif key == "reallocation" and isinstance(value, dict):
            out[key] = f"{value.get('from')} -> {value.get('to')} at step {value.get('at_step')}"
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
    return out


class CsvLogger:
    """``<run dir>/metrics.csv``, one row per logged step; steps after ``resume_step`` that an
    earlier attempt wrote are dropped when it opens."""

    name = "csv"

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        self.header: List[str] = []
        self.rows: List[Dict[str, Any]] = []
        if self.path.is_file():
            with open(self.path, newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                self.header = list(reader.fieldnames or [])
                self.rows = [r for r in reader if _int(r.get("step")) <= resume_step]
        self._rewrite()

    def _rewrite(self) -> None:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.header, extrasaction="ignore")
        if self.header:
            writer.writeheader()
            writer.writerows(self.rows)
        atomic_write_text(self.path, buf.getvalue())

    def write(self, row: Dict[str, Any]) -> None:
        """Append one step (the whole file is rewritten when a new column appears)."""
        flat = flat_row(_clean(row))
        self.rows.append(flat)
        new = [k for k in flat if k not in self.header]
        if new:
            self.header.extend(new)
            self._rewrite()
            return
        check_write(self.path, ask=False)  # metrics.jsonl asked for this row
        with open(self.path, "a", newline="", encoding="utf-8") as fh:
            csv.DictWriter(fh, fieldnames=self.header, extrasaction="ignore").writerow(flat)

    def close(self) -> None:
        """Nothing stays open between rows."""


def _int(text: Any) -> int:
    try:
        return int(float(text))
    except (TypeError, ValueError):
        return 0


def _quiet_tensorboard_threads() -> None:
    """TensorBoard writes events in a thread that re-raises its error there (a traceback on the
    console) and again in the caller's next call, where :class:`RunLoggers` turns it into one
    warning: silence the thread's copy only (other threads' errors still reach the old hook)."""
    previous = threading.excepthook
    if getattr(previous, "hetseq_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(
            args.exc_type, Exception
        ):
            return
        previous(args)

    hook.hetseq_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorBoardLogger:
    """Event files in ``<run dir>/tb`` (``torch.utils.tensorboard``); ``purge_step`` makes
    TensorBoard drop the events an earlier attempt wrote after ``resume_step``."""

    name = "tensorboard"

    def __init__(self, directory: Path, resume_step: int = 0, config_text: str = ""):
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(directory)
        _quiet_tensorboard_threads()
        self.writer = SummaryWriter(
            log_dir=str(directory), purge_step=resume_step + 1, flush_secs=10
        )
        if config_text and resume_step == 0:
            self.writer.add_text("config", f"```\n{config_text}\n```", 0)

    def write(self, row: Dict[str, Any]) -> None:
        """Scalars of one step, one curve per rank for the per-rank figures."""
        step = int(row["step"])
        for key, tag in TB_SCALARS.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), step)
        for rank in row.get("ranks") or []:
            for key, prefix in TB_RANK_FIELDS.items():
                if isinstance(rank.get(key), (int, float)):
                    self.writer.add_scalar(f"{prefix}/rank{rank['rank']}", float(rank[key]), step)
        move = row.get("reallocation")
        if isinstance(move, dict):
            self.writer.add_text(
                "reallocation",
                f"step {move.get('at_step')}: {move.get('from')} -> {move.get('to')}",
                step,
            )

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbLogger:
    """One W&B run per run directory (id kept in ``wandb_id.txt``), offline unless
    ``WANDB_MODE`` is set; ``wandb`` drops steps it has already seen, so a resume adds none
    twice."""

    name = "wandb"

    def __init__(self, run_dir: RunDir, config: Dict[str, Any]):
        import wandb

        self.path = run_dir.wandb
        id_file = run_dir.wandb_id
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        atomic_write_text(id_file, run_id + "\n")
        self.run = wandb.init(
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            name=run_dir.root.name,
        )

    def write(self, row: Dict[str, Any]) -> None:
        """Log the scalars and per-rank figures of one step."""
        flat = {
            k: v
            for k, v in flat_row(_clean(row)).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        self.run.log(flat, step=int(row["step"]))

    def close(self) -> None:
        """Finish the W&B run."""
        self.run.finish()


def logger_fix(name: str, path: Path) -> str:
    """The fix for optional logger ``name`` that cannot write to ``path``: what is in the way,
    else make it writable; always also "drop it from trainer.loggers"."""
    path = Path(path)
    wants_dir = name != "csv"
    if path.exists() or path.is_symlink():
        if wants_dir and not path.is_dir():
            return (
                f"{path} is not a directory: remove or rename it, or drop {name} from "
                "trainer.loggers"
            )
        if not wants_dir and path.is_dir():
            return (
                f"{path} is a directory: remove or rename it, or drop {name} from trainer.loggers"
            )
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return (
            f"{blocker} is a file where a directory is needed: remove or rename it, or drop "
            f"{name} from trainer.loggers"
        )
    return f"make {path} writable (or free its disk), or drop {name} from trainer.loggers"


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "no message"
    return f"{type(exc).__name__}: {text}"


class RunLoggers:
    """Rank 0's loggers behind one ``write(row)`` / ``close()``; ``metrics.jsonl`` is always
    among them and its failures are raised. Metrics never stop a run: an optional logger (csv,
    tensorboard, wandb) that fails to open, to write or to close logs ONE warning naming its
    path and the fix and is dropped; training goes on.

    Args:
        run_dir: the run directory.
        names: ``trainer.loggers``.
        resume_step: the checkpoint's step (0 for a fresh run).
        config: the run's configuration as plain data (TensorBoard text, W&B config).
        keep_membership: opened inside the running job (a new rank 0 after a recovery or a
            join): ``metrics.jsonl`` keeps its membership rows past ``resume_step``
            (:class:`~hetseq_hpc.train.metrics.rows.MetricsWriter`).
    """

    def __init__(
        self,
        run_dir: RunDir,
        names: Sequence[str],
        resume_step: int = 0,
        config: Optional[Dict[str, Any]] = None,
        keep_membership: bool = False,
    ):
        self.sinks: List[Any] = [MetricsWriter(run_dir.metrics, resume_step, keep_membership)]
        wanted = [n for n in dict.fromkeys(names) if n != "jsonl"]
        for name in wanted:
            missing = missing_logger_package(name)
            if missing:
                log.warning(
                    "trainer.loggers has %s but the %s package is not installed: "
                    "skipping it (pip install %s)",
                    name,
                    missing,
                    missing,
                )
                continue
            path = {"csv": run_dir.metrics_csv, "tensorboard": run_dir.tensorboard}.get(
                name, run_dir.wandb
            )
            try:
                self.sinks.append(self._open(name, run_dir, resume_step, config))
            except Exception as exc:
                log.warning(
                    "trainer.loggers: %s cannot write to %s (%s); training goes on without it: %s",
                    name,
                    path,
                    _reason(exc),
                    logger_fix(name, path),
                )

    @staticmethod
    def _open(
        name: str, run_dir: RunDir, resume_step: int, config: Optional[Dict[str, Any]]
    ) -> Any:
        if name == "csv":
            return CsvLogger(run_dir.metrics_csv, resume_step)
        if name == "tensorboard":
            import yaml

            text = yaml.safe_dump(config, sort_keys=False) if config else ""
            return TensorBoardLogger(run_dir.tensorboard, resume_step, text)
        return WandbLogger(run_dir, config or {})

    def _drop(self, sink: Any, doing: str, exc: BaseException) -> None:
        """Warn once about an optional logger that failed, and stop using it."""
        log.warning(
            "trainer.loggers: %s failed %s %s (%s); no more rows go to it, training goes on: %s",
            sink.name,
            doing,
            sink.path,
            _reason(exc),
            logger_fix(sink.name, sink.path),
        )
        self.sinks.remove(sink)
        try:  # release what it holds (a TensorBoard writer thread); it already said why
            sink.close()
        except Exception:
            pass

    def write(self, row: Dict[str, Any]) -> None:
        """Give one step row to every logger.

        Raises:
            OSError: ``metrics.jsonl`` cannot be written (the optional loggers never raise).
        """
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception as exc:
                if isinstance(sink, MetricsWriter):
                    raise
                self._drop(sink, "writing to", exc)

    def close(self) -> None:
        """Close every logger (an optional logger's failure is one warning)."""
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as exc:  # a logger must never fail a finished run
                if isinstance(sink, MetricsWriter):
                    log.warning("closing %s failed: %s", METRICS_NAME, _reason(exc))
                    continue
                self._drop(sink, "closing", exc)


def first_logged_loss(run_dir: RunDir) -> Optional[float]:
    """The loss of the first row of ``metrics.jsonl`` (the run's first step, also after a
    resume on another world size), or None."""
    try:
        rows = read_metrics(run_dir.metrics)
    except Exception:
        return None
    for row in rows:
        if isinstance(row.get("loss"), (int, float)):
            return float(row["loss"])
    return None


def open_loggers(
    run: RunConfig, run_dir: RunDir, resume_step: int, keep_membership: bool = False
) -> RunLoggers:
    """:class:`RunLoggers` for ``run.trainer.loggers`` (rank 0 only; ``keep_membership``: inside
    the running job, :class:`RunLoggers`)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.structured(run), resolve=True)
    plain = {str(k): v for k, v in config.items()} if isinstance(config, dict) else None
    return RunLoggers(run_dir, run.trainer.loggers, resume_step, plain, keep_membership)


__all__ = [
    "CSV_NAME",
    "LOGGER_NAMES",
    "TB_DIR",
    "CsvLogger",
    "RunLoggers",
    "TensorBoardLogger",
    "WandbLogger",
    "first_logged_loss",
    "flat_row",
    "logger_fix",
    "missing_logger_package",
    "open_loggers",
]
