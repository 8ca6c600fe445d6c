"""The task contract checked before step 1 in real runs, and the guarded import of a task
module (hetseq_hpc.tasks.custom).

A task that breaks the contract would train silently wrong with uneven batches: a model that
returns the MEAN loss, a count() of 1 per batch, a make_batch whose rows depend on the rank.
Each is refused by a real 2-rank run before step 1, in one line naming the member;
trainer.skip_contract_check=true trains and records the run as inexact. A task module that
exits, has a syntax error or raises while being imported is refused in one line with its file
and line. (The check in-process: tests/unit/test_contract_check.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.runs import hetseq, losses


def _cli(tmp_path: Path, breaches_dir: Path, target: str, *overrides: str, timeout: float = 300):
    return hetseq(
        "task=custom",
        f"task.target={target}",
        f"task.path={breaches_dir}",
        "trainer.max_steps=2",
        "trainer.global_batch_size=32",
        "trainer.val_every=0",
        *overrides,
        f"hydra.run.dir={tmp_path / 'run'}",
        token_cache=tmp_path / "cache",
        cwd=tmp_path,
        timeout=timeout,
    )


def _metrics_rows(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


# ------------------------------------------------------------------ breaches, real 2-rank runs
@pytest.mark.slow
@pytest.mark.parametrize(
    "target, member, pattern",
    [
        (
            "breaches.MeanLoss",
            "forward",
            r"the model of task breaches\.MeanLoss: forward\(\*\*batch\) "
            r"gave a loss of .* MEAN .* return the SUM, e\.g\. F\.cross_entropy\(.*reduction='sum'\)",
        ),
        (
            "breaches.CountOne",
            "count",
            r"task breaches\.CountOne\.count is not additive: 1 for a "
            r"batch of 8 samples but 1 \+ 1 = 2 .* return the number of loss units",
        ),
        (
            "breaches.RankRows",
            "make_batch",
            r"task breaches\.RankRows\.make_batch depends on the "
            r"rank: rank 1's batch of training positions \[.*\] differs from rank 0's in 'x'",
        ),
    ],
)
def test_contract_breach_is_refused_before_step_1(tmp_path, breaches_dir, target, member, pattern):
    proc = _cli(tmp_path, breaches_dir, target, "cluster.ranks=2", "balance.allocation=[24,8]")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # the launcher's one line
    assert last.startswith("hetseq-hpc: error: rank") and "TaskContractError" in last, last
    assert re.search(pattern, last), proc.stderr[-3000:]
    assert _metrics_rows(tmp_path / "run") == 0, "no step may run"


@pytest.mark.slow
def test_skip_contract_check_trains_and_records_inexactness(tmp_path, breaches_dir):
    proc = _cli(
        tmp_path,
        breaches_dir,
        "breaches.MeanLoss",
        "cluster.ranks=1",
        "trainer.skip_contract_check=true",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["exact"] is False
    assert summary["inexact"]["contract_check"] == "skipped"
    assert "trainer.skip_contract_check=true" in summary["inexact"]["reason"]
    assert _metrics_rows(tmp_path / "run") == 2
    assert "NOT known to be exact" in (tmp_path / "run" / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_the_check_changes_nothing_training_uses(tmp_path, breaches_dir):
    """With dropout on, the losses of every step are bit-identical with the check and without
    it (trainer.skip_contract_check=true); that the RNG states and modules' modes are restored
    is shown in-process below."""
    found = {}
    for skip in ("false", "true"):
        (tmp_path / skip).mkdir()
        proc = _cli(
            tmp_path / skip,
            breaches_dir,
            "breaches.Regression",
            "cluster.ranks=1",
            "task.model.dropout=0.5",
            f"trainer.skip_contract_check={skip}",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[skip] = losses(tmp_path / skip / "run")
    assert len(found["false"]) == 2 and found["false"] == found["true"]
    assert (
        "task contract checked on 8 training positions"
        in (tmp_path / "false" / "run" / "logs" / "rank0.log").read_text()
    )


# ------------------------------------------------------------------ guarded import of a task module
@pytest.mark.parametrize(
    "source, pattern",
    [
        (
            "import sys\nsys.exit(0)\n",
            r"module 'broken' called sys\.exit\(0\) while being imported, at .*broken\.py:2: a task "
            r"module must not exit on import",
        ),
        ("raise SystemExit\n", r"called sys\.exit\(None\) while being imported, at .*broken\.py:1"),
        (
            "x = 1\ndef f(:\n    pass\n",
            r"importing module 'broken' failed at .*broken\.py:2 with SyntaxError",
        ),
        (
            "def check():\n    raise ValueError('no data\\nsecond line')\n\n\ncheck()\n",
            r"importing module 'broken' failed at .*broken\.py:2 with ValueError: no data: fix the "
            r"module",
        ),
    ],
)
def test_task_module_failing_at_import_is_one_line_and_exit_2(tmp_path, source, pattern):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "broken.py").write_text(source)
    proc = hetseq(
        "task=custom",
        "task.target=broken.Task",
        f"task.path={folder}",
        "cluster.ranks=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        token_cache=tmp_path / "cache",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("hetseq-hpc: error: task.target='broken.Task'")
    assert re.search(pattern, lines[0]), lines[0]
    assert _metrics_rows(tmp_path / "run") == 0
