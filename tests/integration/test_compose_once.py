"""Issue 42: a run's configuration is composed once. Hydra's config loader counted in the real
command line (tests/helpers/count_compositions.py) for a new run, a resume of it and a
3-point sweep; and a real sweep of Hydra's basic sweeper and launcher (a range and a choice)
writes every point's run directory as before. Cheap paths: ``cluster.dry_run=true`` (a SLURM
run that writes job.sbatch and submits nothing), so no rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import yaml

from hetseq_hpc.config import load_run_config
from tests.helpers.runs import REPO, assert_ok, cli_env

DRY = ["cluster=mixed", "cluster.dry_run=true"]
#: DRY as Hydra's basic sweeper writes a point's overrides
POINT_DRY = ["cluster=mixed", "cluster.dry_run=True"]


def _counted(tmp_path: Path, token_cache: Path, *argv: str):
    """``hetseq-hpc ARGV`` -> (the process, every composition Hydra made)."""
    record = tmp_path / f"compositions{len(list(tmp_path.glob('compositions*')))}.jsonl"
    env = {**cli_env(token_cache), "HETSEQ_TEST_COMPOSITIONS": str(record)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.count_compositions", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, rows


def _task_overrides(overrides: List[str]) -> List[str]:
    return [o for o in overrides if not o.startswith("hydra.")]


def test_a_new_run_its_resume_and_a_sweep_each_compose_once(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    proc, rows = _counted(
        tmp_path, token_cache, *DRY, "trainer.max_steps=7", f"hydra.run.dir={run_dir}"
    )
    assert_ok(proc)
    assert [(r["mode"], _task_overrides(r["overrides"])) for r in rows] == [
        ("RUN", [*DRY, "trainer.max_steps=7"])
    ], rows
    # Hydra wrote .hydra/ from that one composition, as it always did
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) == [
        *DRY,
        "trainer.max_steps=7",
    ]
    hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra["overrides"]["hydra"] == [f"hydra.run.dir={run_dir}", "hydra.mode=RUN"]
    assert load_run_config(run_dir / "hetseq_config.yaml").trainer.max_steps == 7
    hydra_files = {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}

    proc, rows = _counted(tmp_path, token_cache, "trainer.max_steps=9", f"hydra.run.dir={run_dir}")
    assert_ok(proc)
    assert "continuing" in proc.stdout, proc.stdout
    assert len(rows) == 1, rows  # the command line's overrides on the saved run's choices
    assert load_run_config(run_dir / "hetseq_config.yaml").trainer.max_steps == 9
    assert {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files

    sweep = tmp_path / "sweep"
    proc, rows = _counted(
        tmp_path,
        token_cache,
        "-m",
        *DRY,
        "trainer.max_steps=range(2,5)",
        f"hydra.sweep.dir={sweep}",
    )
    assert_ok(proc)
    assert [r["mode"] for r in rows] == ["MULTIRUN", "RUN", "RUN", "RUN"], rows
    points = [_task_overrides(r["overrides"]) for r in rows[1:]]
    assert points == [[*POINT_DRY, f"trainer.max_steps={n}"] for n in (2, 3, 4)], points
    for job, steps in zip(("0", "1", "2"), (2, 3, 4)):
        assert load_run_config(sweep / job / "hetseq_config.yaml").trainer.max_steps == steps
        assert (sweep / job / "job.sbatch").is_file()


def test_a_basic_sweeper_sweep_over_a_range_and_a_choice_runs_every_point(tmp_path, token_cache):
    """Hydra's basic sweeper and basic launcher (its built-in plugins) on ``range`` x
    ``choice``: one job directory per point, each with Hydra's .hydra/ of that point and the
    run it describes; multirun.yaml at the top."""
    sweep = tmp_path / "sweep"
    proc, rows = _counted(
        tmp_path,
        token_cache,
        "-m",
        *DRY,
        "trainer.max_steps=range(2,4)",
        "optim=choice(adamw,finetune)",
        f"hydra.sweep.dir={sweep}",
    )
    assert_ok(proc)
    assert "Launching 4 jobs locally" in proc.stdout, proc.stdout
    assert len(rows) == 5, rows  # the sweep and each of its 4 points, once
    assert (sweep / "multirun.yaml").is_file()
    expected = [(2, "adamw"), (2, "finetune"), (3, "adamw"), (3, "finetune")]
    for job, (steps, optim) in enumerate(expected):
        point = sweep / str(job)
        assert yaml.safe_load((point / ".hydra" / "overrides.yaml").read_text()) == [
            *POINT_DRY,
            f"trainer.max_steps={steps}",
            f"optim={optim}",
        ]
        run = load_run_config(point / "hetseq_config.yaml")
        assert run.trainer.max_steps == steps
        assert run.optim.warmup_steps == (10 if optim == "finetune" else 20), run.optim
        assert (point / "job.sbatch").is_file()
