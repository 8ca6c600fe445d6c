"""Issue 27, "the first hour", with real processes: a user's ``kill -9`` of a rank is not
called out of memory, ``prepare`` on an existing cache says so and where, a model too big for
the machine is refused before anything starts, resuming a forced allocation on another rank
count suggests ``balance.allocation=null``, and a short 2-rank run draws ``ranks.png`` and
says where."""

from __future__ import annotations

import json
import time

from tests.helpers.runs import assert_ok, cli_env, hetseq


def test_prepare_on_an_existing_cache_says_already_prepared_and_where(tmp_path):
    env = cli_env(tmp_path / "cache")

    def prepare():
        return hetseq("prepare", "task.model.max_seq_len=32", env=env)

    first = prepare()
    assert_ok(first)
    assert "prepared task=bert in" in first.stdout
    again = prepare()
    assert_ok(again)
    where = next((tmp_path / "cache").rglob("meta.json")).parent
    assert again.stdout.strip() == (
        f"task=bert was already prepared: {where} (nothing to do; "
        "delete that directory to rebuild it)"
    )


def test_a_model_too_big_for_the_machine_is_refused_before_anything_starts(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = hetseq(
        "task.model.hidden_size=1000000",
        f"hydra.run.dir={run_dir}",
        token_cache=token_cache,
        timeout=300,
    )
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetseq-hpc: error: task=bert has about "), lines
    assert "parameters" in lines[0] and "smaller task.model" in lines[0]
    assert took < 60, f"refused only after {took:.0f} s"
    assert not run_dir.exists(), "something was started or written"


def test_resuming_a_forced_allocation_on_another_rank_count_suggests_null(tmp_path, run_cli):
    first = run_cli(
        tmp_path,
        "cluster.ranks=2",
        "balance.allocation=[20,12]",
        "trainer.max_steps=2",
        "trainer.val_every=0",
    )
    assert_ok(first)
    again = run_cli(tmp_path, "cluster.ranks=3", "trainer.max_steps=4")
    assert again.returncode == 2, again.stderr[-3000:]
    line = again.stderr.strip().splitlines()[-1]
    assert "balance.allocation=[20, 12] has 2 entries but the world size is 3" in line, line
    assert "balance.allocation=null" in line and "balance.allocation=[11,11,10]" in line, line
    fixed = run_cli(tmp_path, "cluster.ranks=3", "balance.allocation=null", "trainer.max_steps=4")
    assert_ok(fixed)


def test_a_short_two_rank_run_draws_its_plot_and_says_where(tmp_path, run_cli):
    """The default trainer.plot=true: ranks.png with the four panels, its path logged by the
    command line and kept in summary.json."""
    proc = run_cli(
        tmp_path,
        "cluster.ranks=2",
        "cluster.speeds=[1.0,0.5]",
        "trainer.global_batch_size=32",
        "trainer.max_steps=20",
        "trainer.val_every=5",
        "balance.allocation=[16,16]",
        "balance.rebalance_every=2",
        plot=True,
    )
    assert_ok(proc)
    png = tmp_path / "ranks.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["plot"] == str(png)
    assert "done: 20 steps" in proc.stdout + proc.stderr
