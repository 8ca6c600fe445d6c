"""Malformed inputs to plan / probe / report and mistyped command lines (issue 26): each is one
``hetseq-hpc: error:`` line naming the file or value and the fix, a non-zero exit (2: bad
input), no traceback, nothing written; a FIFO or a device where a file is expected is named as
such and never opened (no hang), and an unknown subcommand is named with the closest commands.
(The file checks in-process: tests/unit/test_user_input.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hetseq_hpc.cli.parser import COMMANDS
from tests.helpers.runs import REPO, hetseq

#: the planner prints its errors as "hetseq-hpc plan: error:" (tests/integration/test_plan_cli.py relies on it)
PLAN_ERROR = "hetseq-hpc plan: error: "
ERROR = "hetseq-hpc: error: "
#: a local plan of 2 ranks from a probe file (as tests/unit/test_plan.py plans one)
PLAN = [
    "plan",
    "cluster.ranks=2",
    "cluster.speeds=[1.0,0.5]",
    "trainer.global_batch_size=30",
    "balance.max_micro_batch=16",
]


def _hetseq(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m hetseq_hpc ARGS`` (a FIFO that were opened would hang it: the timeout)."""
    return hetseq(*args, cwd=cwd, timeout=timeout)


def _refused(
    proc: subprocess.CompletedProcess, *words: str, code: int = 2, prefix: str = ERROR
) -> str:
    """The one error line of ``proc``: exit ``code``, no traceback, containing ``words``."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == code, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _good_probe() -> dict:
    return {
        "ranks": [
            {
                "rank": r,
                "device": f"cpu @{s}",
                "calibration": {"samples_per_s": t, "max_micro_batch": 16},
            }
            for r, (s, t) in enumerate(((1.0, 60.0), (0.5, 30.0)))
        ]
    }


def _probe_with(**change) -> str:
    """The JSON text of a good probe file with one rank-0 calibration figure replaced."""
    data = _good_probe()
    data["ranks"][0]["calibration"].update(change)
    return json.dumps(data)


# ---------------------------------------------------------------------------------- plan
GOOD = json.dumps(_good_probe())
PLAN_CASES = {
    # the JSON text of plan.probe -> words its error line must hold
    "top-level list": (json.dumps([_good_probe()]), ["holds a list", "'ranks' list"]),
    "ranks are ints": (json.dumps({"ranks": [1, 2]}), ["ranks[0] is a number, not an object"]),
    "ranks a string": (json.dumps({"ranks": "ab"}), ["has no 'ranks' list"]),
    "curve without keys": (
        json.dumps({**_good_probe(), "fitted_curves": [{"per_sample_s": 0.1}]}),
        ["fitted_curves[0] has no overhead_s"],
    ),
    "calibration curve without overhead": (
        _probe_with(per_sample_s=0.01),
        ["ranks[0].calibration has no overhead_s"],
    ),
    "1e308 samples/s": (
        _probe_with(samples_per_s=1e308),
        ["calibration.samples_per_s=1e+308 is out of range"],
    ),
    "1e308 micro-batch": (_probe_with(max_micro_batch=1e308), ["max_micro_batch=1e+308"]),
    "Infinity": (GOOD.replace("60.0", "Infinity"), ["Infinity is not a JSON number"]),
    "1e400": (GOOD.replace("60.0", "1e400"), ["1e400 overflows a float"]),
    "10**400 as an integer": (GOOD.replace("60.0", str(10**400)), ["has 401 digits"]),
    "string sync_s": (
        json.dumps({**_good_probe(), "measured_step": {"sync_s": "x"}}),
        ["measured_step.sync_s is a string"],
    ),
    "100 000-deep nesting": ("[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
    "binary bytes": ("\udcff\udcfe garbage", ["not UTF-8 text"]),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_refuses_a_malformed_probe_file(tmp_path, case):
    text, words = PLAN_CASES[case]
    probe = tmp_path / "probe.json"
    probe.write_bytes(text.encode("utf-8", "surrogateescape"))
    proc = _hetseq(*PLAN, f"plan.probe={probe}")
    line = _refused(proc, f"plan.probe='{probe}'", *words, prefix=PLAN_ERROR)
    assert line.endswith("pass the allocation.json written by a hetseq_hpc run")


def test_plan_accepts_the_largest_figures_a_probe_may_hold(tmp_path):
    """The bounds that refuse 1e308 leave room for any real device: the extremes still plan."""
    data = _good_probe()
    data["ranks"][0]["calibration"].update(
        samples_per_s=1e15,
        per_sample_s=1e-12,
        overhead_s=1e6,
        step_fixed_s=1e6,
        memory_budget_bytes=1e18,
        static_bytes=0,
        activation_bytes_per_sample=1,
        max_micro_batch=2**31,
    )
    data["ranks"][1]["calibration"].update(samples_per_s=1e-6, max_micro_batch=2**31)
    data["measured_step"] = {"sync_s": 1e6}
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(data))
    proc = _hetseq(*PLAN, f"plan.probe={probe}")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["world_size"] == 2


def test_plan_probe_names_what_the_path_is(tmp_path):
    """A FIFO, a device or a directory at the probe's name is named as such, never opened."""
    fifo = tmp_path / "probe.fifo"
    os.mkfifo(fifo)
    (tmp_path / "run" / "allocation.json").mkdir(parents=True)
    for path, words in (
        (fifo, "is not a regular file (a FIFO)"),
        ("/dev/zero", "is not a regular file (a character device)"),
        (tmp_path / "run", "allocation.json) is a directory, not a file"),
        (tmp_path / "none.json", "does not exist"),
    ):
        proc = _hetseq(*PLAN, f"plan.probe={path}", timeout=60)
        _refused(proc, str(path), words, "pass the allocation.json", prefix=PLAN_ERROR)


# ---------------------------------------------------------------------------------- probe
def test_probe_out_that_cannot_be_written_is_refused_before_probing(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    for out, words in (
        (tmp_path, "is a directory, not a file"),
        (afile / "probe.json", f"cannot be created ({afile} is a file"),
        (fifo, "is not a regular file (a FIFO)"),
        ("/dev/null", "is not a regular file (a character device)"),
    ):
        proc = _hetseq("probe", "--out", str(out), timeout=60)
        _refused(proc, f"--out {out} ", words, "give a writable file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "out.fifo"]
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_probe_out_in_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        proc = _hetseq("probe", "--out", str(folder / "p.json"), timeout=60)
        _refused(proc, f"{folder} is not writable")
    finally:
        folder.chmod(0o700)


APPEND_CASES = {
    "ranks a string": (b'{"ranks": "abc"}', "has no 'ranks' list"),
    "top-level list": (b"[1, 2]", "holds a list"),
    "ranks are ints": (b'{"ranks": [1, 2]}', "ranks[0] is a number, not an object"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\xff", "is not UTF-8 text"),
    "empty": (b"", "is not valid JSON"),
}


@pytest.mark.parametrize("case", list(APPEND_CASES))
def test_probe_append_onto_a_file_of_the_wrong_shape(tmp_path, case):
    content, words = APPEND_CASES[case]
    out = tmp_path / "lab.json"
    out.write_bytes(content)
    proc = _hetseq("probe", "--out", str(out), "--append", timeout=60)
    _refused(proc, f"--append to {out}:", words, "it is not a probe file")
    assert out.read_bytes() == content  # untouched


# ---------------------------------------------------------------------------------- report
def _row(n: int, **change) -> dict:
    rank = {
        "rank": 0,
        "device": "cpu",
        "partition": "local",
        "micro_batch": 4,
        "accum_steps": 1,
        "samples": 4,
        "step_time_s": 0.11,
        "compute_time_s": 0.1,
    }
    row = {"step": n, "loss": 2.0 / n, "samples_per_s": 40.0, "allocation": [4], "ranks": [rank]}
    row.update(change)
    return row


def _metrics(run_dir: Path, rows) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_bytes(
        b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows)
    )
    return path


REPORT_CASES = {
    "string rank": (
        [_row(1, ranks=[{"rank": "zero"}]), _row(2)],
        "row 1 ranks[0].rank is a string",
    ),
    "fractional rank": (
        [_row(1), _row(2, ranks=[{"rank": 0.5}])],
        "ranks[0].rank=0.5 is not a whole",
    ),
    "string ranks": ([_row(1, ranks="abc"), _row(2)], "row 1 ranks is a string, not a list"),
    "int entries in ranks": ([_row(1, ranks=[1]), _row(2)], "ranks[0] is a number, not an object"),
    "string step": ([_row(1, step="x"), _row(2)], "row 1 step is a string"),
    "string loss": ([_row(1, loss="low"), _row(2)], "row 1 loss is a string"),
    "list row": ([[1, 2], _row(1)], "line 1 is a list, not a JSON object"),
    "binary bytes": ([b"\xff\xfe\x00\x01\x89PNG\n", _row(1)], "line 1 is not UTF-8 text"),
    "deep nesting": ([b"[" * 100_000 + b"]" * 100_000 + b"\n", _row(1)], "nested too deeply"),
    "reallocation.to an int": (
        [_row(1, reallocation={"to": 3, "at_step": 2}), _row(2)],
        "reallocation.to is a number",
    ),
}


@pytest.mark.parametrize("case", list(REPORT_CASES))
def test_report_refuses_malformed_metrics_rows(tmp_path, case):
    rows, words = REPORT_CASES[case]
    path = _metrics(tmp_path / "run", rows)
    proc = _hetseq("report", str(tmp_path / "run"), timeout=60)
    _refused(proc, str(path), words)
    assert not (tmp_path / "run" / "ranks.png").exists()


def test_report_on_null_losses_prints_n_a(tmp_path):
    """A NaN loss is logged as null (metrics.jsonl has no NaN): the report still draws."""
    _metrics(tmp_path, [_row(1, loss=None), _row(2, loss=None)])
    proc = _hetseq("report", str(tmp_path), timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "loss n/a -> n/a" in proc.stdout
    assert (tmp_path / "ranks.png").read_bytes()[:4] == b"\x89PNG"


def test_report_out_that_cannot_be_written(tmp_path):
    _metrics(tmp_path / "run", [_row(1), _row(2)])
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, words in (
        (tmp_path, "is a directory, not a file"),
        (afile / "x.png", f"cannot be created ({afile} is a file"),
        (tmp_path / "x.xyz", "matplotlib cannot write .xyz files"),
        # /proc takes no new folder, whoever runs this (root included, for
        # whom os.access says it is writable): refused before the write
        ("/proc/hetseq-no-such/x.png", "cannot be created (/proc "),
    ):
        proc = _hetseq("report", str(tmp_path / "run"), "--out", str(out), timeout=60)
        _refused(proc, str(out), words, "--out")
    assert not (tmp_path / "run" / "ranks.png").exists()


def test_report_names_what_the_path_is(tmp_path):
    """A FIFO or a directory at metrics.jsonl, a device as the run directory: named, not
    opened (no hang), and not said to be missing."""
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "metrics.jsonl")
    (tmp_path / "dir" / "metrics.jsonl").mkdir(parents=True)
    for run_dir, words in (
        (tmp_path / "fifo", "metrics.jsonl is not a regular file (a FIFO)"),
        (tmp_path / "dir", "metrics.jsonl is a directory, not a file"),
        ("/dev/zero", "/dev/zero is not a run directory (it is a character device)"),
        (tmp_path / "none", "metrics.jsonl does not exist"),
    ):
        proc = _hetseq("report", str(run_dir), timeout=60)
        line = _refused(proc, words, "pass the run directory")
        assert ("does not exist" in line) == (run_dir == tmp_path / "none")


# ---------------------------------------------------------------------------------- commands
@pytest.mark.parametrize(
    "argv, words",
    [
        (["trian", "task=bert"], ["unknown command 'trian'", "did you mean 'run' (train)?"]),
        (["pln"], ["unknown command 'pln'", "did you mean 'plan'?"]),
        (["foo"], ["unknown command 'foo': commands: run, plan"]),
        (["task=bert", "trian"], ["'trian' is not an override", "hetseq-hpc run --help"]),
        (["plan", "trian"], ["'trian' is not an override", "hetseq-hpc plan --help"]),
        (["task=bert", "plan"], ["'plan' after 'run' is not an override", "hetseq-hpc plan"]),
    ],
)
def test_an_unknown_command_is_named_not_hydras_missing_equal(argv, words, tmp_path):
    proc = _hetseq(*argv, cwd=tmp_path, timeout=60)
    line = _refused(proc, *words)
    assert "EQUAL" not in line
    if argv[0] not in COMMANDS and "=" not in argv[0]:
        assert ", ".join(COMMANDS) in line
    assert list(tmp_path.iterdir()) == []  # nothing started, no run directory
