"""Composing the real Hydra config (conf/) and validating it; nothing is launched."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

import hetseq_hpc.config
from hetseq_hpc.config import (
    BertTaskConfig,
    LocalClusterConfig,
    RunConfig,
    load_run_config,
    save_run_config,
    to_run_config,
)
from hetseq_hpc.errors import ConfigError


@pytest.fixture
def compose_cfg():
    """``compose_cfg(*overrides)`` -> composed DictConfig of conf/config.yaml."""
    hetseq_hpc.config.register_configs()
    with initialize_config_dir(config_dir=str(hetseq_hpc.config.CONF_DIR), version_base="1.3"):
        yield lambda *overrides: compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def run_config(compose_cfg):
    """``run_config(*overrides)`` -> validated RunConfig."""
    return lambda *overrides: to_run_config(compose_cfg(*overrides))


# --------------------------------------------------------------------------- defaults
def test_defaults(run_config):
    # cluster.ranks pinned: the default world size depends on this machine's GPUs
    run = run_config("cluster.ranks=2")
    assert isinstance(run, RunConfig)
    assert isinstance(run.task, BertTaskConfig)
    assert isinstance(run.cluster, LocalClusterConfig)
    assert run.task.name == "bert"
    assert run.cluster.name == "local"
    assert run.trainer.global_batch_size == 32
    assert run.trainer.allocation is None
    assert run.trainer.resume == "auto"
    assert run.trainer.precision == "auto"
    assert run.optim.name == "adamw"
    assert run.task.model.hidden_size == 128
    assert run.task.data.files == []


def test_defaults_without_overrides(compose_cfg):
    cfg = compose_cfg()
    assert cfg.task.name == "bert"
    assert cfg.cluster.name == "local"
    assert cfg.cluster.ranks is None
    assert cfg.trainer.global_batch_size == 32
    run = to_run_config(cfg)  # world size = GPUs here, else 2: both <= 32
    assert run.cluster.ranks is None


@pytest.mark.parametrize(
    "overrides, getter, value",
    [
        pytest.param(["cluster.ranks=3"], lambda r: r.cluster.ranks, 3, id="cluster.ranks"),
        pytest.param(["cluster.ranks=2", "trainer.global_batch_size=64"],
                     lambda r: r.trainer.global_batch_size, 64, id="global_batch_size"),
        pytest.param(["cluster.ranks=2", "trainer.allocation=[24,8]"],
                     lambda r: r.trainer.allocation, [24, 8], id="allocation"),
        pytest.param(["cluster.ranks=2", "trainer.max_steps=7"],
                     lambda r: r.trainer.max_steps, 7, id="max_steps"),
        pytest.param(["cluster.ranks=2", "trainer.seed=1234"],
                     lambda r: r.trainer.seed, 1234, id="seed"),
        pytest.param(["cluster.ranks=2", "trainer.resume=never"],
                     lambda r: r.trainer.resume, "never", id="resume-never"),
        pytest.param(["cluster.ranks=2", "trainer.resume=/tmp/ckpt/step_10.pt"],
                     lambda r: r.trainer.resume, "/tmp/ckpt/step_10.pt", id="resume-path"),
        pytest.param(["cluster.ranks=2", "task.model.dropout=0.0"],
                     lambda r: r.task.model.dropout, 0.0, id="dropout-0"),
        pytest.param(["cluster.ranks=2", "task.model.dropout=0.25"],
                     lambda r: r.task.model.dropout, 0.25, id="dropout-0.25"),
    ],
)
def test_overrides(run_config, overrides, getter, value):
    assert getter(run_config(*overrides)) == value


def test_allocation_override_with_matching_world(run_config):
    run = run_config("cluster.ranks=3", "trainer.global_batch_size=12",
                     "trainer.allocation=[6,4,2]")
    assert run.trainer.allocation == [6, 4, 2]
    assert hetseq_hpc.config.planned_world_size(run) == 3


def test_existing_data_files_are_accepted(run_config, tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "b.txt").write_text("more text\n")
    run = run_config("cluster.ranks=2", f"task.data.files=[{tmp_path}/*.txt]")
    assert run.task.data.files == [f"{tmp_path}/*.txt"]


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "overrides, names",
    [
        pytest.param(["cluster.ranks=0"], ["cluster.ranks=0"], id="ranks-0"),
        pytest.param(["cluster.ranks=-1"], ["cluster.ranks=-1"], id="ranks-negative"),
        pytest.param(["cluster.ranks=2", "trainer.global_batch_size=1"],
                     ["trainer.global_batch_size=1", "world size 2"], id="batch-below-world"),
        pytest.param(["cluster.ranks=2", "trainer.allocation=[20,8]"],
                     ["trainer.allocation", "28", "32"], id="allocation-wrong-sum"),
        pytest.param(["cluster.ranks=2", "trainer.allocation=[16,8,8]"],
                     ["trainer.allocation", "3 entries", "world size is 2"],
                     id="allocation-wrong-length"),
        pytest.param(["cluster.ranks=2", "trainer.allocation=[32,0]"],
                     ["trainer.allocation"], id="allocation-zero-entry"),
        pytest.param(["cluster.ranks=2", "task.data.files=[/nonexistent/*.txt]"],
                     ["task.data.files", "/nonexistent/*.txt"], id="missing-data-file"),
        pytest.param(["cluster.ranks=2", "task.model.num_heads=3"],
                     ["task.model.num_heads=3", "128"], id="heads-do-not-divide-hidden"),
        pytest.param(["cluster.ranks=2", "task.model.dropout=1.0"],
                     ["task.model.dropout"], id="dropout-1"),
        pytest.param(["cluster.ranks=2", "optim.lr=0"], ["optim.lr"], id="lr-0"),
        pytest.param(["cluster.ranks=2", "trainer.precision=fp8"],
                     ["trainer.precision", "fp8"], id="precision-fp8"),
        pytest.param(["cluster.ranks=2", "trainer.max_steps=0"], ["trainer.max_steps"],
                     id="max-steps-0"),
        pytest.param(["cluster.ranks=2", "trainer.resume=''"], ["trainer.resume"],
                     id="resume-empty"),
        pytest.param(["cluster.ranks=2", "cluster.speeds=[1.0]"], ["cluster.speeds"],
                     id="speeds-length"),
        pytest.param(["cluster.ranks=2", "optim.schedule_steps=10"], ["optim.schedule_steps"],
                     id="schedule-shorter-than-run"),
    ],
)
def test_config_errors(run_config, overrides, names):
    with pytest.raises(ConfigError) as info:
        run_config(*overrides)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


def test_unknown_task_is_a_hydra_error(compose_cfg):
    with pytest.raises(HydraException) as info:
        compose_cfg("task=nope")
    assert "task" in str(info.value)


def test_unknown_task_name_in_plain_dict():
    with pytest.raises(ConfigError) as info:
        to_run_config({"task": {"name": "nope"}, "cluster": {"name": "local", "ranks": 2}})
    assert "task" in str(info.value) and "nope" in str(info.value)
    assert "\n" not in str(info.value)


def test_plain_dict_is_accepted():
    run = to_run_config({"task": {"name": "bert"}, "cluster": {"name": "local", "ranks": 2},
                         "trainer": {"allocation": [20, 12]}})
    assert run.trainer.allocation == [20, 12]
    assert run.task.model.hidden_size == 128


def test_type_error_names_the_key():
    with pytest.raises(ConfigError) as info:
        to_run_config({"task": {"name": "bert"}, "cluster": {"name": "local", "ranks": 2},
                       "trainer": {"global_batch_size": "abc"}})
    assert "trainer.global_batch_size" in str(info.value)


# --------------------------------------------------------------------------- save / load
def test_save_load_round_trip(run_config, tmp_path):
    run = run_config("cluster.ranks=2", "trainer.allocation=[24,8]", "trainer.max_steps=9",
                     "trainer.seed=5", "task.model.dropout=0.0", "trainer.resume=never")
    path = save_run_config(run, tmp_path / "run" / "hetseq_config.yaml")
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["hetseq_config.yaml"]  # no .tmp left
    back = load_run_config(path)
    assert back == run
    assert isinstance(back.task, BertTaskConfig)
    assert back.trainer.allocation == [24, 8]
    # saving again gives the same text
    again = save_run_config(back, tmp_path / "again.yaml")
    assert again.read_text() == path.read_text()


def test_load_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_run_config(missing)
    assert str(missing) in str(info.value)
    assert "\n" not in str(info.value)


def test_load_directory_is_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path)


INVALID_YAML = [
    pytest.param("trainer: {global_batch_size: 32\n", id="unclosed-flow-mapping"),
    pytest.param("task:\n\t- bert\n", id="tab-indent"),
    pytest.param("a: [1, 2\n", id="unclosed-flow-sequence"),
]


@pytest.mark.parametrize("text", INVALID_YAML)
def test_load_invalid_yaml(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert str(path) in str(info.value)
    assert "not valid YAML" in str(info.value)
    assert "\n" not in str(info.value), "one line"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("- 1\n- 2\n", id="a-list"),
        pytest.param("task: {name: bert}\ncluster: {name: local, ranks: 0}\n", id="bad-value"),
        pytest.param("task: {name: bert}\ncluster: {name: local, ranks: 2}\ntrainer: {foo: 1}\n",
                     id="unknown-key"),
    ],
)
def test_load_valid_yaml_invalid_config(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- CLI
def _run_cli(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "hetseq_hpc", *overrides, f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )


def _assert_nothing_started(tmp_path):
    assert not (tmp_path / "logs").exists()
    assert not list(tmp_path.rglob("metrics.jsonl"))
    assert not list(tmp_path.rglob("allocation.json"))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "override, names",
    [
        pytest.param("cluster.ranks=0", ["cluster.ranks"], id="ranks-0"),
        pytest.param("trainer.allocation=[20,8]", ["trainer.allocation"], id="allocation-sum"),
    ],
)
def test_cli_config_error_exits_2_and_starts_nothing(tmp_path, override, names):
    proc = _run_cli(tmp_path, override)
    assert proc.returncode == 2, proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("hetseq-hpc: error:")]
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
