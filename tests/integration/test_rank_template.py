"""The rank template (``cluster.rank_start=fork``, docs/design/rank-template.md): a forked rank
gets what an exec'd one would -- its own environment, the ranks' process group, stdin from
/dev/null, ``python -m`` semantics -- plus torch already imported, and its exit status reaches
the launcher as ``Popen`` would give it. Real processes, real fork; a stand-in module is the
rank (``tests/helpers/template_child.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from hetseq_hpc.launch.template import ORPHAN_CODE, RankTemplate, TemplateError
from tests.helpers.runs import REPO
from tests.helpers.waits import wait_for

CHILD = ["-m", "tests.helpers.template_child"]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("RANK", None)
    env.update(extra)
    return env


@pytest.fixture
def template(tmp_path):
    made = RankTemplate(_env(SHARED="template"), argv_tail=["--run-dir", str(tmp_path)])
    yield made
    made.close()
    made._proc.kill()  # a no-op when close() saw it end
    made._proc.wait()


def test_the_template_imports_the_runs_preload_modules_and_skips_one_it_cannot(tmp_path):
    """``--preload`` (a task's ``rank_imports``): the forked rank finds them imported; a module
    that does not import is left to the rank (which would name it), not the template's end."""
    made = RankTemplate(
        _env(),
        argv_tail=["--run-dir", str(tmp_path), "--preload", "wave,no_such_module_here,tabnanny"],
    )
    try:
        out = tmp_path / "r0.json"
        assert made.spawn(_env(RANK="0"), [*CHILD, str(out), "0"]).wait(timeout=120) == 0
        assert json.loads(out.read_text())["preloaded"] == ["tabnanny", "wave"]
    finally:
        made.close()
        made._proc.kill()
        made._proc.wait()


def test_forked_ranks_get_their_environment_group_and_name_and_report_their_exit(
    tmp_path, template
):
    outs = [tmp_path / "r0.json", tmp_path / "r1.json"]
    first = template.spawn(
        _env(RANK="0", ONLY_RANK="zero", SHARED="rank"), [*CHILD, str(outs[0]), "wait"]
    )
    second = template.spawn(
        _env(RANK="1", ONLY_RANK="one", SHARED="rank"), [*CHILD, str(outs[1]), "7"], first.pid
    )
    assert second.wait(timeout=120) == 7
    wait_for(outs[0].exists, "rank 0's facts")
    facts = [json.loads(o.read_text()) for o in outs]
    assert first.poll() is None  # still waiting for its go
    (tmp_path / "r0.go").touch()
    assert first.wait(timeout=60) == 0
    for rank, (fact, only) in enumerate(zip(facts, ["zero", "one"])):
        assert fact["rank"] == str(rank) and fact["only_rank"] == only
        assert fact["shared"] == "rank", "the rank's environment replaces the template's"
        assert fact["pgid"] == first.pid, "every rank in rank 0's process group"
        assert fact["ppid"] == template.pid
        assert fact["name"] == f"hetseq-rank{rank}"
        assert fact["main"] == "__main__" and fact["argv"][0].endswith("template_child.py")
        assert fact["argv"][1:] == [str(outs[rank]), "wait" if rank == 0 else "7"]
        assert fact["torch_preloaded"] and fact["gc_enabled"] and fact["stdin_is_null"]
        assert fact["preloaded"] == [], "no --preload: nothing beyond torch"


def test_a_signalled_rank_reports_minus_the_signal_and_a_dead_template_refuses_more(
    tmp_path, template
):
    out = tmp_path / "r.json"
    rank = template.spawn(_env(RANK="0"), [*CHILD, str(out), "wait"])
    wait_for(out.exists, "the rank's facts")
    rank.kill()
    assert rank.wait(timeout=60) == -signal.SIGKILL
    rank.kill()  # ended: nothing is sent (its pid may belong to someone else now)
    template._proc.kill()
    template._proc.wait()
    with pytest.raises(TemplateError, match="rank template"):
        template.spawn(_env(RANK="1"), [*CHILD, str(tmp_path / "r1.json"), "0"])


def test_ranks_of_a_killed_template_stop_and_count_as_sighup(tmp_path, template):
    """The template dies under a running rank: the rank gets its parent-death SIGHUP (a stop
    request to a real worker; this stand-in dies of it), and the launcher, whose exit status
    died with the template, counts it as SIGHUP once the process is gone."""
    out = tmp_path / "r.json"
    rank = template.spawn(_env(RANK="0"), [*CHILD, str(out), "wait"])
    wait_for(out.exists, "the rank's facts")
    os.kill(template.pid, signal.SIGKILL)
    assert rank.wait(timeout=60) == ORPHAN_CODE == -signal.SIGHUP


def test_a_request_that_is_not_python_dash_m_is_refused(template):
    with pytest.raises(ValueError, match="-m MODULE"):
        template.spawn(_env(RANK="0"), ["tests/helpers/template_child.py"])
    assert isinstance(template._proc, subprocess.Popen)
