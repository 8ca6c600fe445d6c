"""``end_process`` ends a real process as a normal exit would, less the teardown of its modules:
its exit status, its threads' and ``atexit`` handlers' work and its buffered output all reach
the outside; and a finished rank and a CLI command that imported torch end through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.helpers.runs import REPO

#: a process with what a normal exit finishes: a non-daemon thread still working, a thread
#: pool's queued task, an atexit handler, a logging file handler and unflushed stdout
SCRIPT = textwrap.dedent(
    """
    import atexit, concurrent.futures, logging, sys, threading, time
    from pathlib import Path
    from hetseq_hpc.env.process_end import end_process

    out = Path(sys.argv[1])
    def late():
        time.sleep(0.3)
        (out / "thread").write_text("joined")
    threading.Thread(target=late).start()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(lambda: (time.sleep(0.2), (out / "pool").write_text("ran")))
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    handler = logging.FileHandler(out / "log.txt")
    logging.getLogger("t").addHandler(handler)
    logging.getLogger("t").warning("logged")
    sys.stdout.write("no newline, still buffered")
    end_process(int(sys.argv[2]))
    (out / "after").write_text("must not run")
    """
)


def test_end_process_keeps_what_a_normal_exit_finishes_and_its_status(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline, still buffered"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "pool").read_text() == "ran"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "log.txt").read_text() == "logged\n"
    assert not (tmp_path / "after").exists()


def test_a_finished_rank_and_a_command_with_torch_end_without_the_teardown(tmp_path):
    """``exit_process(0)`` (a rank's end) and ``hetseq-hpc``'s ``main`` after a command that
    imported torch go through ``end_process``: a spy on it in the child records the call."""
    spy = textwrap.dedent(
        """
        import json, sys
        import hetseq_hpc.env.process_end as pe
        real, record, what = pe.end_process, sys.argv[1], sys.argv[2]
        def recorded(code):
            with open(record, "a") as fh:
                fh.write(json.dumps({"code": code, "torch": "torch" in sys.modules}) + "\\n")
            real(code)
        pe.end_process = recorded
        import hetseq_hpc.env.rank_guard as guard
        guard.end_process = recorded
        if what == "rank":
            guard.exit_process(0)
        import torch  # noqa: F401  (as an elastic run's launcher or task=hf's checks do)
        from hetseq_hpc.cli import main
        sys.argv = ["hetseq-hpc", "task=nonexistent"]  # one line, exit 2, nothing written
        main()
        """
    )
    record = tmp_path / "calls.jsonl"
    for what, code in (("rank", 0), ("cli", 2)):
        proc = subprocess.run(
            [sys.executable, "-c", spy, str(record), what],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.returncode == code, proc.stderr
    assert "task=nonexistent is not an option" in proc.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls == [{"code": 0, "torch": False}, {"code": 2, "torch": True}], calls
