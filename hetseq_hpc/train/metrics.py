"""``metrics.jsonl`` (one JSON object per logged step, written by rank 0) and the progress bar."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends rows to ``<run dir>/metrics.jsonl``, flushed after every row so a crash loses
    nothing already logged. On resume, rows of steps after the checkpoint are dropped first,
    so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._truncate_after(resume_step)
        self._fh = open(self.path, "a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        keep: List[str] = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if int(row.get("step", 0)) <= step:
                keep.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        tmp.replace(self.path)

    def write(self, row: Dict[str, Any]) -> None:
        """Append one row."""
        self._fh.write(json.dumps(_clean(row), sort_keys=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """All rows of a ``metrics.jsonl``."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


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

    def update(self, step: int, loss: float, samples_per_s: float, extra: Optional[str] = None) -> None:
        """Report step ``step``."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.1f}")
        elif step % self.every == 0 or step == self.total or step == 1:
            log.info(
                "step %d/%d loss %.4f %.1f samples/s%s",
                step, self.total, loss, samples_per_s, f" {extra}" if extra else "",
            )

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()
