"""The hetseq-hpc command line: subcommands, --help/--version, and the first-hour frictions
(resume from the saved configuration, checks before anything starts or is written, a rejected
submission leaves no run directory, a rendered job.sbatch submitted by hand completes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hetseq_hpc import __version__
from hetseq_hpc.cli.parser import COMMANDS
from tests.helpers.runs import SMALL_MODEL, cli_env, hetseq, read_rows, start_hetseq


def _one_error_line(proc, code: int = 2) -> str:
    assert proc.returncode == code, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetseq-hpc: error: "), proc.stderr
    return lines[0]


def test_help_lists_every_subcommand_on_one_line():
    proc = hetseq("--help")
    assert proc.returncode == 0, proc.stderr
    for name in COMMANDS:
        assert any(line.split()[:1] == [name] for line in proc.stdout.splitlines()), name
    assert "Hydra" not in proc.stdout.splitlines()[0] and "powered by Hydra" not in proc.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_subcommand_has_help(name):
    proc = hetseq(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: hetseq-hpc {name}")


def test_run_help_names_options_but_not_internal_schemas():
    out = hetseq("run", "--help").stdout
    assert "bert" in out and "testcluster" in out
    assert "_schema" not in out


def test_version_is_hetseq_hpc_s():
    proc = hetseq("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"hetseq-hpc {__version__}"


def test_help_into_a_closed_pipe_ends_quietly():
    """`hetseq-hpc --help | head -0`: the reader is gone before anything is written."""
    proc = start_hetseq("--help", text=False)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize(
    "args",
    [["task=bert_schema"], ["plan", "cluster=slurm_schema"], ["run", "trainer=trainer_schema"]],
)
def test_internal_schema_is_not_an_option(tmp_path, args):
    line = _one_error_line(hetseq(*args, f"hydra.run.dir={tmp_path / 'r'}"))
    assert "internal schema" in line
    assert not (tmp_path / "r").exists()


def test_plan_subcommand_prints_the_plan():
    """The default BERT (1.5 M parameters) on 16 GPUs pays the spec model's fixed time per
    micro-batch pass on every rank, so it needs a large global batch to use them: 16384 (the
    plan predicts 0.31 of ideal at 4096). Batch building is left out
    (``plan.data_ms_per_sample=0``): the plan times it on the machine that plans, and on a slow
    CPU (this VM, 2026-11-29: 0.093 ms per sample) it bounds every GPU class alike, which
    leaves nothing to balance."""
    proc = hetseq(
        "plan",
        "cluster=mixed",
        "task=bert",
        "trainer.global_batch_size=16384",
        "plan.data_ms_per_sample=0",
    )
    assert proc.returncode == 0, proc.stderr
    headline = json.loads(proc.stdout.strip().splitlines()[-1])
    assert headline["efficiency"] > 0.5 and headline["speedup_vs_equal"] > 1


@pytest.mark.slow
def test_probe_writes_json_that_plan_reads(tmp_path, token_cache):
    proc = hetseq(
        "probe",
        "task=bert",
        *SMALL_MODEL,
        "balance.calibration_steps=1",
        token_cache=token_cache,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path and path.name.startswith("probe-")
    data = json.loads(path.read_text())
    assert data["ranks"] and data["ranks"][0]["calibration"]["samples_per_s"] > 0
    assert data["ranks"][0]["probe"]["kind"] == "cpu"
    proc = hetseq(
        "plan",
        "cluster=local",
        "cluster.ranks=2",
        *SMALL_MODEL,
        f"plan.probe={path}",
        token_cache=token_cache,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "probe" in proc.stdout


def test_render_writes_a_job_script_and_its_log_folder(tmp_path, token_cache):
    run_dir = tmp_path / "r"
    proc = hetseq(
        "render",
        "cluster=testcluster",
        "task=bert",
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    script = (run_dir / "job.sbatch").read_text()
    assert (run_dir / "submitit").is_dir()  # sbatch does not create its --output folder
    assert f"--output={run_dir / 'submitit'}/%j_batch.out" in script
    assert (run_dir / "hetseq_config.yaml").is_file()
    line = _one_error_line(hetseq("render", "cluster=local", f"hydra.run.dir={tmp_path / 'l'}"))
    assert "cluster=local" in line


def test_render_with_a_partition_given_on_the_command_line(tmp_path, token_cache):
    """Through Hydra's own entry point: the new partition is a het component of the script."""
    run_dir = tmp_path / "r"
    proc = hetseq(
        "render",
        "cluster=testcluster",
        "task=bert",
        f"hydra.run.dir={run_dir}",
        "+cluster.partitions.extra={partition: debug, nodes: 1, cpus_per_rank: 1}",
        token_cache=token_cache,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = (run_dir / "hetseq_config.yaml").read_text()
    assert "extra:" in saved and "partition: debug" in saved
    assert "--partition=debug" in (run_dir / "job.sbatch").read_text()


@pytest.mark.slow
def test_report_prints_a_summary_and_draws_the_png(tmp_path, run_cli):
    run_dir = tmp_path / "run"
    assert run_cli(run_dir, "cluster.ranks=1", "trainer.max_steps=3").returncode == 0
    proc = hetseq("report", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "loss" in proc.stdout and "rank 0" in proc.stdout
    assert (run_dir / "ranks.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_resume_uses_the_saved_configuration_and_checks_before_writing(tmp_path, run_cli):
    """The second command repeats none of the first one's overrides; a forgotten/mismatching
    override and a missing trainer.resume file fail in one line before anything is written."""
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "cluster.ranks=2", "trainer.max_steps=3", "trainer.val_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {
        name: (run_dir / name).read_bytes()
        for name in (
            "hetseq_config.yaml",
            "allocation.json",
            ".hydra/overrides.yaml",
            ".hydra/config.yaml",
        )
    }
    # a model override that does not fit the checkpoint: refused, nothing rewritten
    bad = run_cli(run_dir, "task.model.hidden_size=32", small=False)
    line = _one_error_line(bad, code=1)
    assert "task.model.hidden_size" in line and "checkpoint" in line
    missing = run_cli(run_dir, f"trainer.resume={tmp_path / 'nope.pt'}", small=False)
    assert "does not exist" in _one_error_line(missing, code=1)
    for name, data in records.items():
        assert (run_dir / name).read_bytes() == data, name
    # only the run directory and the new step count: continues on 1 rank from step 3
    proc = run_cli(run_dir, "trainer.max_steps=5", "cluster.ranks=1", small=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3, 4, 5]
    assert (run_dir / ".hydra/overrides.yaml").read_bytes() == records[".hydra/overrides.yaml"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_loss"] == read_rows(run_dir)[0]["loss"]  # the run's, not step 4's
    assert "continuing" in (run_dir / "cli.log").read_text()


def test_missing_resume_file_on_a_new_run_is_caught_before_start(tmp_path):
    line = _one_error_line(
        hetseq(f"trainer.resume={tmp_path / 'x.pt'}", f"hydra.run.dir={tmp_path / 'r'}"), code=1
    )
    assert "trainer.resume=" in line and "does not exist" in line
    assert not (tmp_path / "r").exists()


def test_a_resume_file_hetseq_did_not_write_is_caught_before_start(tmp_path):
    """A trainer.resume file without its .sha256 sidecar (a data file, a checkpoint copied
    without it) is refused before any rank starts or any job is submitted (the ranks refused
    it after starting, or on the cluster after the queue wait); nothing is created."""
    wrong = tmp_path / "data.jsonl"
    wrong.write_text('{"text": "not a checkpoint"}\n')
    for cluster in ("cluster=local", "cluster=mixed"):
        line = _one_error_line(
            hetseq(cluster, f"trainer.resume={wrong}", f"hydra.run.dir={tmp_path / 'r'}"), code=1
        )
        assert str(wrong) in line and "data.jsonl.sha256 is missing or unreadable" in line
        assert not (tmp_path / "r").exists()


def test_rejected_slurm_attempt_leaves_no_run_directory(tmp_path, token_cache):
    env = cli_env(token_cache)
    env["PATH"] = str(Path(sys.executable).parent)  # no sbatch / sinfo: the launch is refused
    run_dir = tmp_path / "r"
    proc = hetseq("cluster=testcluster", f"hydra.run.dir={run_dir}", env=env)
    assert proc.returncode != 0
    assert "sbatch" in proc.stderr or "sinfo" in proc.stderr
    assert not run_dir.exists()
