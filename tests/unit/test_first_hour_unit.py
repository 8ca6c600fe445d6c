"""Issue 27, "the first hour", in process: a SIGKILL is called OOM only on the kernel's word,
the plan's device column is never cut, a forced allocation of the wrong length suggests
``balance.allocation=null``, a model too big for a rank is refused from its parameter count,
a waited Slurm job prints the summary line, and the plot's four panels have data."""

from __future__ import annotations

import json
import logging
import math
import signal
from pathlib import Path

import pytest

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.launch.failures import signal_reason
from hetseq_hpc.rundir.paths import RunDir

NOT_OOM = "killed by SIGKILL (by a user, the scheduler, or the OOM killer)"


# ------------------------------------------------------------------ kill -9 is not OOM
def test_a_sigkill_is_called_oom_only_with_the_kernels_evidence(tmp_path):
    alloc = {
        "ranks": [
            {
                "calibration": {"static_bytes": 2**30, "activation_bytes_per_sample": 2**28},
                "share": {"micro_batch": 4},
            }
        ]
    }
    (tmp_path / "allocation.json").write_text(json.dumps(alloc))
    assert signal_reason(-signal.SIGKILL, RunDir(tmp_path), 0) == NOT_OOM
    oom = signal_reason(-signal.SIGKILL, RunDir(tmp_path), 0, oom="the kernel log names pid 7")
    assert "out of memory" in oom and "the kernel log names pid 7" in oom and "2.00 GiB" in oom
    assert (
        oom.endswith("lower cluster.memory_budget_gb, shrink task.model or balance.max_micro_batch")
        and "\n" not in oom
    )
    assert signal_reason(-signal.SIGSEGV, RunDir(tmp_path), 0) == "killed by signal SIGSEGV"


def test_oom_evidence_from_the_cgroup_counter_or_the_kernel_log():
    from hetseq_hpc.env.memcg import oom_evidence

    before = {"/sys/fs/cgroup/memory/x/memory.oom_control": 1}
    same = dict(before)
    rose = {k: v + 1 for k, v in before.items()}
    assert oom_evidence(before, 4242, after=same, log=[]) is None
    assert "oom_kill 1 -> 2" in oom_evidence(before, 4242, after=rose, log=[])
    log = ["Out of memory: Killed process 4242 (python) total-vm:1kB, anon-rss:1kB"]
    assert oom_evidence(before, 4242, after=same, log=log) == "the kernel log names pid 4242"
    assert oom_evidence(before, 424, after=same, log=log) is None  # another process
    cgroup_log = ["oom-kill:constraint=CONSTRAINT_MEMCG,task=python,pid=99,uid=0"]
    assert oom_evidence({}, 99, after={}, log=cgroup_log) is not None


def _fake_cgroup_root(tmp_path: Path, files: dict) -> Path:
    """A copy of this process's memory cgroup layout under ``tmp_path`` with ``files`` in
    its deepest directories (v1 ``memory`` hierarchy and v2 unified, as /proc says)."""
    root = tmp_path / "cgroup"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            base = root
        elif "memory" in controllers.split(","):
            base = root / "memory"
        else:
            continue
        folder = base / rel.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    return root


def test_cgroup_counters_and_room_are_read_from_this_process_cgroup(tmp_path):
    from hetseq_hpc.env.memcg import cgroup_memory_room, oom_kill_counts

    root = _fake_cgroup_root(
        tmp_path,
        {
            "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
            "memory.events": "low 0\nhigh 0\nmax 0\noom 1\noom_kill 5\n",
            "memory.limit_in_bytes": str(4 * 2**30),
            "memory.usage_in_bytes": str(2**30),
        },
    )
    counts = oom_kill_counts(root=root)
    assert counts and set(counts.values()) <= {3, 5}
    assert cgroup_memory_room(root=root) == 3 * 2**30
    unlimited = _fake_cgroup_root(tmp_path / "u", {"memory.max": "max", "memory.current": "5"})
    assert cgroup_memory_room(root=unlimited) is None


# ------------------------------------------------------------------ plan's device column
@pytest.mark.parametrize("cluster", ["mixed", "campus64"])
def test_plan_prints_every_device_label_whole(cluster):
    from hetseq_hpc.plan.command import compose_plan_run
    from hetseq_hpc.plan.planner import make_plan
    from hetseq_hpc.plan.render import render

    plan = make_plan(compose_plan_run([f"cluster={cluster}", "trainer.global_batch_size=4096"]))
    text = render(plan)
    labels = {spec.partition: spec.device for spec in plan.ranks}
    assert len(labels) >= 3
    for partition, label in labels.items():
        assert label in text, f"{partition}: {label!r} cut in\n{text}"
    assert any(len(label) > 24 for label in labels.values())  # what was cut before


# ------------------------------------------------------------------ forced allocation, new world
def test_a_forced_allocation_of_another_length_suggests_null():
    with pytest.raises(ConfigError) as err:
        compose_run_config(
            ["cluster.ranks=3", "trainer.global_batch_size=32", "balance.allocation=[20,12]"]
        )
    line = str(err.value)
    assert "\n" not in line and "world size is 3" in line
    assert "balance.allocation=null" in line and "balance.allocation=[11,11,10]" in line


# ------------------------------------------------------------------ a model too big for a rank
def test_param_count_formulas_match_the_real_models():
    import torch

    from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM
    from hetseq_hpc.tasks.sizes import param_count
    from hetseq_hpc.tasks.translation.transformer import TranslationTransformer

    for overrides in (
        [],
        [
            "task.model.num_layers=3",
            "task.model.hidden_size=96",
            "task.model.intermediate_size=200",
        ],
        ["task=translation"],
        ["task=translation", "task.model.num_encoder_layers=1", "task.model.d_model=64"],
        ["task=image"],
    ):
        cfg = compose_run_config(overrides).task
        with torch.device("meta"):
            if cfg.name == "bert":
                model = BertMaskedLM(cfg.model, cfg.data.vocab_size)
            elif cfg.name == "translation":
                model = TranslationTransformer(cfg.model, cfg.data.vocab_size)
            else:
                assert param_count(cfg) is None  # sized by its data: not checked up front
                continue
        assert param_count(cfg) == sum(p.numel() for p in model.parameters()), overrides


def test_a_model_too_big_for_a_rank_is_refused_from_its_parameter_count():
    from hetseq_hpc.cli.preflight import check_model_fits

    check_model_fits(compose_run_config([]))  # the default model fits
    check_model_fits(compose_run_config(["cluster=mixed"]))
    with pytest.raises(ConfigError) as err:
        check_model_fits(compose_run_config(["task.model.hidden_size=1000000"]))
    line = str(err.value)
    assert "\n" not in line and "parameters" in line and "GiB" in line
    assert "smaller task.model" in line and "cluster.memory_budget_gb" in line
    with pytest.raises(ConfigError, match=r"cluster\.memory_budget_gb=0\.01"):
        check_model_fits(compose_run_config(["cluster.memory_budget_gb=0.01"]))
    with pytest.raises(ConfigError, match="partition a100 may use 40 GiB"):
        check_model_fits(compose_run_config(["cluster=mixed", "task.model.hidden_size=100000"]))
    with pytest.raises(ConfigError, match=r"cluster\.partitions\.a100\.memory_budget_gb=0\.01"):
        check_model_fits(
            compose_run_config(["cluster=mixed", "cluster.partitions.a100.memory_budget_gb=0.01"])
        )


# ------------------------------------------------------------------ the waited Slurm job's summary
def test_a_waited_slurm_job_prints_the_summary_line(monkeypatch, tmp_path, caplog):
    import hetseq_hpc.launch.slurm as slurm
    from hetseq_hpc.cli.dispatch import dispatch
    from tests.helpers.slurm import compose_testcluster

    summary = {
        "final_step": 3,
        "first_loss": 9.0,
        "final_loss": 8.5,
        "samples_per_s": 12.0,
        "validation": {"val_loss": 8.4},
        "ranks": [],
        "plot": str(tmp_path / "ranks.png"),
    }
    monkeypatch.setattr(
        slurm, "launch_slurm", lambda run, run_dir: {"job_id": "1", "summary": summary}
    )
    with caplog.at_level(logging.INFO, logger="hetseq_hpc"):
        dispatch(compose_testcluster("cluster.wait=true"), RunDir(tmp_path))
    text = caplog.text
    assert "done: 3 steps, loss 9.0000 -> 8.5000, validation loss 8.4, 12.0 samples/s" in text
    assert f"plot: {tmp_path / 'ranks.png'}" in text
    caplog.clear()
    monkeypatch.setattr(slurm, "launch_slurm", lambda run, run_dir: {"job_id": "1"})
    with caplog.at_level(logging.INFO, logger="hetseq_hpc"):
        dispatch(compose_testcluster(), RunDir(tmp_path))  # not waited for: nothing to sum up
    assert "done:" not in caplog.text


# ------------------------------------------------------------------ the plot
def metrics_rows(steps: int = 30, spike_at: int = 17) -> list:
    """Rows as a 2-rank run writes them: validation every 5 steps, two re-allocations, one
    slow step (``spike_at``)."""
    alloc, rows = [16, 16], []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "loss": 9.0 - 0.1 * step,
            "samples_per_s": 40.0 + step % 3,
            "allocation": list(alloc),
            "ranks": [],
        }
        for rank, (device, speed) in enumerate([("cpu", 40.0), ("cpu @0.5", 20.0)]):
            slow = 30.0 if step == spike_at else 1.0
            row["ranks"].append(
                {
                    "rank": rank,
                    "device": device,
                    "partition": None,
                    "micro_batch": alloc[rank],
                    "accum_steps": 1,
                    "samples": alloc[rank],
                    "compute_time_s": slow * alloc[rank] / speed,
                }
            )
        if step % 5 == 0:
            row["val_loss"] = 9.2 - 0.1 * step
        if step in (6, 11):
            new = [22, 10] if step == 6 else [21, 11]
            row["reallocation"] = {"from": list(alloc), "to": new, "at_step": step + 1}
            alloc = new
        rows.append(row)
    return rows


def _points(line) -> int:
    return sum(1 for y in line.get_ydata() if isinstance(y, (int, float)) and math.isfinite(y))


def test_the_plot_has_loss_throughput_share_and_step_time_panels_with_data():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetseq_hpc.report.figure import TITLES, build_figure

    fig = build_figure(metrics_rows(), "test")
    try:
        axes = fig.get_axes()
        assert [ax.get_title(loc="left") for ax in axes] == list(TITLES)
        for ax in axes:
            assert any(_points(line) > 1 for line in ax.get_lines()), ax.get_title(loc="left")
        loss_ax, _speed_ax, share_ax, time_ax = axes
        labels = [line.get_label() for line in loss_ax.get_lines()]
        assert "training loss" in labels and "validation loss" in labels
        shares = [line for line in share_ax.get_lines() if line.get_label().startswith("rank")]
        assert len(shares) == 2 and max(shares[0].get_ydata()) == pytest.approx(22 / 32)
        # each re-allocation is a vertical line on every panel, numbered once on the share panel
        for ax in axes:
            assert {tuple(line.get_xdata()) for line in ax.get_lines()} >= {(7, 7), (12, 12)}
        assert sorted(t.get_text() for t in share_ax.texts) == ["1", "2"]
        # the one slow step does not squash the step-time panel: clipped, and said so
        assert time_ax.get_ylim()[1] < 5.0
        assert any("not shown to scale" in t.get_text() for t in time_ax.texts)
        # legends sit outside the plotting area (right of it)
        for ax in (loss_ax, share_ax):
            legend = ax.get_legend()
            assert legend is not None
            fig.canvas.draw()
            assert legend.get_window_extent().x0 >= ax.get_window_extent().x1
    finally:
        plt.close(fig)


def test_plot_run_writes_the_png_and_nan_losses_do_not_break_it(tmp_path):
    from hetseq_hpc.report.plots import plot_run

    rows = metrics_rows()
    for row in rows[:3]:
        row["loss"] = None
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plot_run(tmp_path)
    assert path == tmp_path / "ranks.png" and path.read_bytes()[:4] == b"\x89PNG"


def test_plot_is_on_by_default():
    assert compose_run_config([]).trainer.plot is True
