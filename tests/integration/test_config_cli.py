"""The command line refuses a bad configuration value in one line, exit 2, before anything
starts or is written."""

from __future__ import annotations

import pytest

from tests.helpers.runs import hetseq


# --------------------------------------------------------------------------- CLI
def _run_cli(tmp_path, *overrides):
    return hetseq(*overrides, f"hydra.run.dir={tmp_path}", timeout=120, cwd=tmp_path)


def _assert_nothing_started(tmp_path):
    assert not (tmp_path / "logs").exists()
    assert not list(tmp_path.rglob("metrics.jsonl"))
    assert not list(tmp_path.rglob("allocation.json"))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "override, names",
    [
        pytest.param("cluster.ranks=0", ["cluster.ranks"], id="ranks-0"),
        pytest.param("balance.allocation=[20,8]", ["balance.allocation"], id="allocation-sum"),
    ],
)
def test_cli_config_error_exits_2_and_starts_nothing(tmp_path, override, names):
    proc = _run_cli(tmp_path, override)
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("hetseq-hpc: error:")]
    assert len(errors) == 1, proc.stderr
    for name in names:
        assert name in errors[0]
    assert "Traceback" not in proc.stderr
    _assert_nothing_started(tmp_path)


def test_cli_type_error_exits_2(tmp_path):
    proc = _run_cli(tmp_path, "trainer.global_batch_size=abc")
    _assert_nothing_started(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hetseq-hpc: error:")


# --------------------------------------------------------------------------- issue 8: CLI one-liners
CLI_TYPE_ERRORS = [
    pytest.param(
        "trainer.max_steps=abc",
        ["trainer.max_steps='abc'", "an integer", "trainer.max_steps=1000"],
        id="max-steps-abc",
    ),
    pytest.param("cluster.ranks=1.5", ["cluster.ranks=1.5", "an integer"], id="ranks-float"),
    pytest.param(
        "balance.allocation=5",
        ["balance.allocation=5", "a list of integers"],
        id="allocation-scalar",
    ),
    pytest.param("trainer.seed=x", ["trainer.seed='x'", "an integer"], id="seed-str"),
    pytest.param("optim.lr=fast", ["optim.lr='fast'", "a number", "optim.lr=0.001"], id="lr-str"),
    pytest.param("trainer.plot=maybe", ["trainer.plot='maybe'", "true or false"], id="plot-str"),
    pytest.param(
        "task.model.dropout=[1]", ["task.model.dropout=[1]", "a number"], id="dropout-list"
    ),
    pytest.param(
        "cluster.speeds=fast", ["cluster.speeds='fast'", "a list of numbers"], id="speeds-str"
    ),
    pytest.param(
        "balance.allocation=[a,b]",
        ["balance.allocation[0]='a'", "an integer"],
        id="allocation-entry",
    ),
    pytest.param("trainer.resume=[1,2]", ["trainer.resume=[1, 2]", "a string"], id="resume-list"),
]


@pytest.mark.parametrize("override, words", CLI_TYPE_ERRORS)
def test_cli_type_errors_are_one_line_with_key_value_type_and_fix(tmp_path, override, words):
    proc = _run_cli(tmp_path, override)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hetseq-hpc: error:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    line = proc.stderr.strip()
    assert "write e.g." in line, line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    _assert_nothing_started(tmp_path)


@pytest.mark.parametrize(
    "overrides, words",
    [
        pytest.param(["+trainer.max_step=5"], ["did you mean trainer.max_steps?"], id="plus-typo"),
        pytest.param(
            ["cluster=mixed", "cluster.partitions={}"],
            ["cluster.partitions is empty"],
            id="empty-partitions",
        ),
        pytest.param(["trainer.seed=-1"], ["trainer.seed=-1"], id="seed-negative"),
        pytest.param(["optim.lr=inf"], ["optim.lr=inf"], id="lr-inf"),
    ],
)
def test_cli_silently_ignored_or_late_errors_exit_2_before_hydra(tmp_path, overrides, words):
    run_dir = tmp_path / "run"
    proc = hetseq(*overrides, f"hydra.run.dir={run_dir}", timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hetseq-hpc: error:") and proc.stderr.count("\n") == 1
    for word in words:
        assert word in proc.stderr
    assert not run_dir.exists(), "the pre-check runs before Hydra creates the run directory"


def test_cli_unwritable_run_dir_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    proc = hetseq(f"hydra.run.dir={blocker}/x", timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hetseq-hpc: error: hydra.run.dir="), proc.stderr
    assert f"{blocker} is a file" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_cli_run_dir_on_a_filesystem_that_refuses_folders_is_one_line(tmp_path):
    """procfs says it is writable (``os.access`` as root) but takes no new folder: the pre-check
    tries one (created and removed) instead of trusting the permission bits."""
    proc = hetseq("hydra.run.dir=/proc/hetseq-run", timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "hetseq-hpc: error: hydra.run.dir=/proc/hetseq-run cannot be created (/proc "
    ), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_cli_binary_data_file_exits_2_and_starts_nothing(tmp_path):
    data = tmp_path / "corpus.bin"
    data.write_bytes(bytes(range(256)) * 4)
    proc = _run_cli(tmp_path, f"task.data.files=[{data}]")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hetseq-hpc: error: task.data.files") and str(data) in proc.stderr
    _assert_nothing_started(tmp_path)


@pytest.mark.parametrize(
    "sweep, words",
    [
        (["optim.lr=1e-4,abc"], "optim.lr='abc' is not valid: expected a number"),
        (["cluster.ranks=range(0,2)"], "cluster.ranks=0 is invalid"),
        (
            ["task=bert,image", "task.model.hidden_size=8"],
            "task.model.hidden_size is not a setting",
        ),
    ],
)
def test_a_bad_value_in_a_sweep_is_one_line_before_any_point_runs(tmp_path, sweep, words):
    """``-m``: every value of every swept override is composed and validated before Hydra
    starts (each with the other sweeps at their first value: a point of the grid), so a bad
    one is one line, exit 2, and no sweep directory is made (Hydra refused it with a
    multi-line report)."""
    proc = hetseq(
        "-m",
        *sweep,
        "trainer.max_steps=2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("hetseq-hpc: error: ") and words in line, line
    assert not (tmp_path / "sweep").exists()
