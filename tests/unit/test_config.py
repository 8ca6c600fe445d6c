"""Composing the real Hydra config (conf/) and validating it, in-process; nothing is launched.
(The command line refusing bad values: tests/integration/test_config_cli.py.)"""

from __future__ import annotations

import re
import shutil

import pytest
from omegaconf import OmegaConf

import hetseq_hpc.config
from hetseq_hpc.config import (
    BertTaskConfig,
    ClusterConfig,
    LocalClusterConfig,
    RunConfig,
    compose_run,
    compose_run_config,
    load_run_config,
    save_run_config,
    to_run_config,
)
from hetseq_hpc.config.schema import (
    BalanceConfig,
    CommConfig,
    OptimConfig,
    PlanConfig,
    PrecisionConfig,
    ShardingConfig,
    TrainerConfig,
)
from hetseq_hpc.errors import ConfigError


@pytest.fixture
def compose_cfg():
    """``compose_cfg(*overrides)`` -> composed DictConfig of conf/config.yaml."""
    return lambda *overrides: compose_run(list(overrides))


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
    assert isinstance(run.cluster, ClusterConfig) and run.cluster.is_local
    assert run.trainer.allow_resume_mismatch is False
    assert run.task.name == "bert"
    assert run.cluster.name == "local"
    assert run.trainer.global_batch_size == 32
    assert run.balance.allocation is None
    assert run.trainer.resume == "auto"
    assert run.precision.default == "auto"
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
        pytest.param(
            ["cluster.ranks=2", "trainer.global_batch_size=64"],
            lambda r: r.trainer.global_batch_size,
            64,
            id="global_batch_size",
        ),
        pytest.param(
            ["cluster.ranks=2", "balance.allocation=[24,8]"],
            lambda r: r.balance.allocation,
            [24, 8],
            id="allocation",
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.max_steps=7"],
            lambda r: r.trainer.max_steps,
            7,
            id="max_steps",
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.seed=1234"], lambda r: r.trainer.seed, 1234, id="seed"
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.resume=never"],
            lambda r: r.trainer.resume,
            "never",
            id="resume-never",
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.resume=/tmp/ckpt/step_10.pt"],
            lambda r: r.trainer.resume,
            "/tmp/ckpt/step_10.pt",
            id="resume-path",
        ),
        pytest.param(
            ["cluster.ranks=2", "task.model.dropout=0.0"],
            lambda r: r.task.model.dropout,
            0.0,
            id="dropout-0",
        ),
        pytest.param(
            ["cluster.ranks=2", "task.model.dropout=0.25"],
            lambda r: r.task.model.dropout,
            0.25,
            id="dropout-0.25",
        ),
    ],
)
def test_overrides(run_config, overrides, getter, value):
    assert getter(run_config(*overrides)) == value


def test_allocation_override_with_matching_world(run_config):
    run = run_config(
        "cluster.ranks=3", "trainer.global_batch_size=12", "balance.allocation=[6,4,2]"
    )
    assert run.balance.allocation == [6, 4, 2]
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
        pytest.param(
            ["cluster.ranks=2", "trainer.global_batch_size=1"],
            ["trainer.global_batch_size=1", "world size 2"],
            id="batch-below-world",
        ),
        pytest.param(
            ["cluster.ranks=2", "balance.allocation=[20,8]"],
            ["balance.allocation", "28", "32"],
            id="allocation-wrong-sum",
        ),
        pytest.param(
            ["cluster.ranks=2", "balance.allocation=[16,8,8]"],
            ["balance.allocation", "3 entries", "world size is 2"],
            id="allocation-wrong-length",
        ),
        pytest.param(
            ["cluster.ranks=2", "balance.allocation=[32,0]"],
            ["balance.allocation"],
            id="allocation-zero-entry",
        ),
        pytest.param(
            ["cluster.ranks=2", "task.data.files=[/nonexistent/*.txt]"],
            ["task.data.files", "/nonexistent/*.txt"],
            id="missing-data-file",
        ),
        pytest.param(
            ["cluster.ranks=2", "task.model.num_heads=3"],
            ["task.model.num_heads=3", "128"],
            id="heads-do-not-divide-hidden",
        ),
        pytest.param(
            ["cluster.ranks=2", "task.model.dropout=1.0"], ["task.model.dropout"], id="dropout-1"
        ),
        pytest.param(["cluster.ranks=2", "optim.lr=0"], ["optim.lr"], id="lr-0"),
        pytest.param(
            ["cluster.ranks=2", "precision.default=fp8"],
            ["precision.default", "fp8"],
            id="precision-fp8",
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.max_steps=0"], ["trainer.max_steps"], id="max-steps-0"
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.resume=''"], ["trainer.resume"], id="resume-empty"
        ),
        pytest.param(
            ["cluster.ranks=2", "cluster.speeds=[1.0]"], ["cluster.speeds"], id="speeds-length"
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.elastic.min_ranks=3"],
            ["trainer.elastic.min_ranks=3", "world size 2", "cluster.ranks=2", "min_ranks=2"],
            id="min-ranks-above-local-world",
        ),
        pytest.param(
            ["cluster=mixed", "trainer.elastic.min_ranks=17"],
            ["trainer.elastic.min_ranks=17", "world size 16", "a100: 4 + v100: 8 + t4: 4"],
            id="min-ranks-above-slurm-world",
        ),
        pytest.param(
            ["cluster.ranks=2", "optim.schedule_steps=10"],
            ["optim.schedule_steps"],
            id="schedule-shorter-than-run",
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.elastic.restarts=-1"],
            ["trainer.elastic.restarts=-1", ">= 0"],
            id="restarts-negative",
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.elastic.restarts=1", "trainer.elastic.spare_nodes=1"],
            ["trainer.elastic.spare_nodes=1", "cluster=local", "spare_nodes=0"],
            id="spare-nodes-on-local",
        ),
        pytest.param(
            ["cluster=mixed", "trainer.elastic.spare_nodes=1"],
            ["trainer.elastic.spare_nodes=1", "trainer.elastic.restarts=0", "restarts"],
            id="spare-nodes-without-restarts",
        ),
        pytest.param(
            ["cluster=mixed", "trainer.elastic.spare_nodes=-1"],
            ["trainer.elastic.spare_nodes=-1", ">= 0"],
            id="spare-nodes-negative",
        ),
        pytest.param(
            ["cluster.ranks=2", "trainer.elastic.enabled=false", "trainer.elastic.restarts=2"],
            ["trainer.elastic.restarts=2", "trainer.elastic.enabled=false"],
            id="restarts-without-elastic",
        ),
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
    with pytest.raises(ConfigError) as info:
        compose_cfg("task=nope")
    assert "task=nope" in str(info.value) and "bert" in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_task_name_in_plain_dict():
    with pytest.raises(ConfigError) as info:
        to_run_config({"task": {"name": "nope"}, "cluster": {"name": "local", "ranks": 2}})
    assert "task" in str(info.value) and "nope" in str(info.value)
    assert "\n" not in str(info.value)


def test_plain_dict_is_accepted():
    run = to_run_config(
        {
            "task": {"name": "bert"},
            "cluster": {"name": "local", "ranks": 2},
            "trainer": {"allocation": [20, 12]},
        }
    )
    assert run.balance.allocation == [20, 12]
    assert run.task.model.hidden_size == 128


def test_type_error_names_the_key():
    with pytest.raises(ConfigError) as info:
        to_run_config(
            {
                "task": {"name": "bert"},
                "cluster": {"name": "local", "ranks": 2},
                "trainer": {"global_batch_size": "abc"},
            }
        )
    assert "trainer.global_batch_size" in str(info.value)


# --------------------------------------------------------------------------- save / load
def test_save_load_round_trip(run_config, tmp_path):
    run = run_config(
        "cluster.ranks=2",
        "balance.allocation=[24,8]",
        "trainer.max_steps=9",
        "trainer.seed=5",
        "task.model.dropout=0.0",
        "trainer.resume=never",
    )
    path = save_run_config(run, tmp_path / "run" / "hetseq_config.yaml")
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["hetseq_config.yaml"]  # no .tmp left
    back = load_run_config(path)
    assert back == run
    assert isinstance(back.task, BertTaskConfig)
    assert back.balance.allocation == [24, 8]
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
    # issue 26: a directory is named as one, not as "does not exist"
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_run_config(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "hetseq_config.yaml")


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
        pytest.param(
            "task: {name: bert}\ncluster: {name: local, ranks: 2}\ntrainer: {foo: 1}\n",
            id="unknown-key",
        ),
    ],
)
def test_load_valid_yaml_invalid_config(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- typed cluster config
def test_cluster_field_is_typed_with_the_base_schema(run_config):
    import typing

    assert typing.get_type_hints(RunConfig)["cluster"] is ClusterConfig
    local = run_config("cluster.ranks=3").cluster
    slurm = run_config("cluster=mixed").cluster
    assert local.is_local and not slurm.is_local
    assert local.planned_world_size() == 3
    assert slurm.planned_world_size() == slurm.world_size == 4 + 8 + 4
    assert slurm.memory_budget_gb is None and slurm.collective_timeout_s == 600
    assert [slurm.partition_of_rank(r) for r in (0, 3, 4, 11, 12, 15, 16)] == [
        "a100",
        "a100",
        "v100",
        "v100",
        "t4",
        "t4",
        None,
    ]


# --------------------------------------------------------------------------- issue 8: sbatch values
@pytest.mark.parametrize("value", ["a100\n", "a100\nsrun evil", "a100 ", "", "a$(id)", "a;b"])
def test_sbatch_values_are_anchored_at_the_true_end(value):
    from hetseq_hpc.config.common import check_sbatch_value

    with pytest.raises(ConfigError) as info:
        check_sbatch_value("cluster.job_name", value)
    assert "\n" not in str(info.value).replace(repr(value), "")


def test_trailing_newline_in_job_name_is_rejected(run_config):
    with pytest.raises(ConfigError, match=r"cluster\.job_name"):
        to_run_config(
            {
                "task": {"name": "bert"},
                "cluster": {
                    "name": "slurm",
                    "job_name": "hetseq\n",
                    "partitions": {"a100": {"partition": "a100"}},
                },
            }
        )


EVIL_CLUSTER = """\
defaults:
  - slurm_schema
  - _self_

name: slurm
partitions:
  "a100\\necho pwned > /tmp/hetseq-pwned":
    partition: a100
    gpu_type: a100
"""


def test_partition_key_with_a_newline_is_rejected_through_hydra(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(hetseq_hpc.config.CONF_DIR, conf)
    (conf / "cluster" / "evil.yaml").write_text(EVIL_CLUSTER)
    cfg = compose_run(["cluster=evil"], config_dir=conf)
    assert (
        "a100\necho pwned > /tmp/hetseq-pwned" in cfg.cluster.partitions
    )  # the YAML really has it
    with pytest.raises(ConfigError) as info:
        to_run_config(cfg)
    message = str(info.value)
    assert message.startswith("cluster.partitions key=") and "not allowed in an sbatch" in message


def test_partition_key_with_a_newline_is_rejected_from_a_saved_config(tmp_path):
    path = tmp_path / "hetseq_config.yaml"
    path.write_text(
        "task: {name: bert}\ncluster:\n  name: slurm\n  partitions:\n"
        '    "a100\\necho pwned":\n      partition: a100\n'
    )
    with pytest.raises(ConfigError, match=r"cluster\.partitions key"):
        load_run_config(path)


# --------------------------------------------------------------------------- issue 8: ignored overrides
@pytest.mark.parametrize(
    "overrides, expected",
    [
        pytest.param(["+trainer.max_step=5"], "did you mean trainer.max_steps?", id="plus-typo"),
        pytest.param(["trainer.max_step=5"], "did you mean trainer.max_steps?", id="typo"),
        pytest.param(["+trainr.max_steps=5"], "did you mean trainer?", id="plus-group-typo"),
        pytest.param(["+optim.learning_rate=1"], "the keys of optim are name, lr", id="no-match"),
        pytest.param(["+cluster.rank=3"], "did you mean cluster.ranks?", id="plus-cluster"),
        pytest.param(
            ["cluster=mixed", "+cluster.partitions.a100.gpu_typ=x"],
            "did you mean cluster.partitions.a100.gpu_type?",
            id="plus-partition",
        ),
        pytest.param(
            ["+task.model.hidden=64"], "did you mean task.model.hidden_size?", id="plus-nested"
        ),
    ],
)
def test_unknown_keys_are_errors_with_a_suggestion(run_config, overrides, expected):
    with pytest.raises(ConfigError) as info:
        run_config(*overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_empty_partitions_override_is_an_error(run_config, compose_cfg):
    with pytest.raises(ConfigError, match=r"cluster\.partitions is empty"):
        run_config("cluster=mixed", "cluster.partitions={}")
    assert dict(compose_cfg("cluster=mixed", "cluster.env={}").cluster.env) == {}
    # a non-empty dict override still merges into the old one (Hydra's documented behaviour)
    cfg = compose_cfg("cluster=mixed", "cluster.partitions={a100: {nodes: 3}}")
    assert list(cfg.cluster.partitions) == ["a100", "v100", "t4"]
    assert cfg.cluster.partitions.a100.nodes == 3


# --------------------------------------------------------------------------- issue 8: ranges
@pytest.mark.parametrize(
    "overrides, names",
    [
        pytest.param(["trainer.seed=-1"], ["trainer.seed=-1", "0..4294967295"], id="seed-negative"),
        pytest.param(["trainer.seed=4294967296"], ["trainer.seed=4294967296"], id="seed-2^32"),
        pytest.param(["trainer.seed=18446744073709551616"], ["trainer.seed="], id="seed-2^64"),
        pytest.param(
            ["balance.calibration_micro_batch=-4"],
            ["balance.calibration_micro_batch=-4"],
            id="calibration-micro-batch-negative",
        ),
        pytest.param(
            ["balance.calibration_micro_batch=0"],
            ["balance.calibration_micro_batch=0"],
            id="calibration-micro-batch-0",
        ),
        pytest.param(["optim.lr=inf"], ["optim.lr=inf", "finite"], id="lr-inf"),
        pytest.param(["optim.lr=nan"], ["optim.lr=nan", "finite"], id="lr-nan"),
        pytest.param(["optim.weight_decay=inf"], ["optim.weight_decay"], id="weight-decay-inf"),
        pytest.param(["optim.eps=nan"], ["optim.eps"], id="eps-nan"),
        pytest.param(["trainer.grad_clip=inf"], ["trainer.grad_clip"], id="grad-clip-inf"),
        pytest.param(
            ["balance.rebalance_threshold=nan"],
            ["balance.rebalance_threshold"],
            id="rebalance-threshold-nan",
        ),
        pytest.param(["cluster.speeds=[1.0,nan]"], ["cluster.speeds"], id="speeds-nan"),
        pytest.param(
            ["cluster.memory_budget_gb=inf"], ["cluster.memory_budget_gb"], id="memory-budget-inf"
        ),
        pytest.param(
            ["cluster=mixed", "cluster.partitions.a100.memory_budget_gb=inf"],
            ["cluster.partitions.a100.memory_budget_gb"],
            id="partition-budget-inf",
        ),
        pytest.param(
            ["cluster=mixed", "cluster.partitions.v100.emulate_speed=nan"],
            ["cluster.partitions.v100.emulate_speed"],
            id="partition-speed-nan",
        ),
        pytest.param(
            ["cluster=mixed", "cluster.max_num_timeout=-1"],
            ["cluster.max_num_timeout=-1"],
            id="max-num-timeout-negative",
        ),
        pytest.param(
            ["cluster=mixed", "cluster.timeout_min=525601"],
            ["cluster.timeout_min=525601", "525600"],
            id="timeout-min-absurd",
        ),
    ],
)
def test_range_errors(run_config, overrides, names):
    with pytest.raises(ConfigError) as info:
        run_config(*(["cluster.ranks=2"] if overrides[0] != "cluster=mixed" else []), *overrides)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


def test_range_edges_are_accepted(run_config):
    run = run_config(
        "cluster.ranks=2", "trainer.seed=4294967295", "balance.calibration_micro_batch=1"
    )
    assert run.trainer.seed == 2**32 - 1 and run.balance.calibration_micro_batch == 1
    assert (
        run_config(
            "cluster=mixed", "cluster.max_num_timeout=0", "cluster.timeout_min=525600"
        ).cluster.timeout_min
        == 525600
    )


# --------------------------------------------------------------------------- issue 8: data files
def test_data_file_with_glob_characters_in_its_name(run_config, tmp_path):
    real = tmp_path / "data[1].txt"
    real.write_text("real text in a file whose name holds glob characters\n")
    run = run_config("cluster.ranks=2", f"task.data.files=['{real}']")
    assert run.task.data.files == [str(real)]
    from hetseq_hpc.config.validate import expand_data_files

    assert expand_data_files([str(real)]) == [str(real)]


@pytest.mark.parametrize(
    "content, words",
    [
        pytest.param(b"", ["is empty"], id="empty"),
        pytest.param(b"  \n\n\t\n", ["is empty"], id="only-whitespace"),
        pytest.param(b"PK\x03\x04\x00\x00binary", ["binary"], id="binary-nul"),
        pytest.param("caf\u00e9 latin-1\n".encode("latin-1"), ["not UTF-8"], id="latin-1"),
    ],
)
def test_bad_data_files_are_one_line_errors(run_config, tmp_path, content, words):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        run_config("cluster.ranks=2", f"task.data.files=[{path}]")
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "UTF-8 text" in message
    for word in words:
        assert word in message


def test_multibyte_character_cut_by_the_probe_is_fine(tmp_path):
    from hetseq_hpc.config.validate import check_text_file

    path = tmp_path / "t.txt"
    path.write_text("h\u00e9llo w\u00f6rld\n", encoding="utf-8")
    for probe in range(1, 16):  # every cut, including inside a two-byte character
        check_text_file(str(path), probe_bytes=probe)


@pytest.mark.parametrize(
    "overrides,interval",
    [
        ([], 10),  # measured split: re-balanced
        (["balance.allocation=[24,8]", "cluster.ranks=2"], 0),  # the user's split is kept
        (["balance.rebalance_every=3"], 3),
        (["balance.rebalance_every=0"], 0),
        (["balance.allocation=[24,8]", "cluster.ranks=2", "balance.rebalance_every=5"], 5),
    ],
)
def test_rebalance_interval_defaults_to_on_for_a_measured_split(run_config, overrides, interval):
    assert run_config(*overrides).balance.rebalance_interval == interval


def test_negative_rebalance_every_is_refused(run_config):
    with pytest.raises(ConfigError, match=r"balance\.rebalance_every=-1"):
        run_config("balance.rebalance_every=-1")


def test_keys_that_moved_between_groups_keep_working(tmp_path):
    """trainer.allocation & co. moved to the balance / comm / precision groups: an old command
    line is rewritten (prefix and value kept), and a hetseq_config.yaml saved before the move
    still loads, so such a run directory resumes."""
    from omegaconf import OmegaConf

    from hetseq_hpc.config import load_run_config, save_run_config
    from hetseq_hpc.config.aliases import migrate_overrides

    assert migrate_overrides(
        [
            "trainer.allocation=[24,8]",
            "+trainer.grad_combine=sum",
            "cluster.partitions.v100.precision=fp16",
            "trainer.max_steps=3",
            "precision.partitions.t4=fp32",
        ]
    ) == [
        "balance.allocation=[24,8]",
        "+comm.grad_combine=sum",
        "++precision.partitions.v100=fp16",
        "trainer.max_steps=3",
        "++precision.partitions.t4=fp32",
    ]
    run = compose_run_config(
        [
            "cluster=mixed",
            "balance.allocation=null",
            "precision.partitions.v100=fp16",
            "comm.bucket_cap_mb=10",
        ]
    )
    saved = OmegaConf.to_container(OmegaConf.structured(run))
    # the shape an older version wrote: everything under trainer, precision in the cluster
    saved["trainer"].update(
        allocation=None,
        max_micro_batch=8,
        calibration_steps=4,
        calibration_micro_batch=None,
        rebalance_every=5,
        rebalance_threshold=0.1,
        precision="bf16",
        grad_compression="none",
        bucket_cap_mb=10.0,
        grad_combine="sum",
    )
    saved["cluster"]["partitions"]["v100"]["precision"] = "fp16"
    saved["cluster"]["partitions"]["t4"]["precision"] = None
    for group in ("balance", "comm", "precision"):
        del saved[group]
    path = tmp_path / "hetseq_config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    old = load_run_config(path)
    assert old.balance.max_micro_batch == 8 and old.balance.rebalance_every == 5
    assert old.comm.bucket_cap_mb == 10.0
    assert old.precision.default == "bf16" and old.precision.partitions == {"v100": "fp16"}
    assert load_run_config(save_run_config(old, tmp_path / "again.yaml")) == old


def test_a_whole_new_partition_from_the_command_line():
    """``+cluster.partitions.xp={...}`` adds a partition (Hydra alone refuses a dict there),
    validated as in YAML; a partition already there is merged into."""
    run = compose_run_config(
        [
            "cluster=mixed",
            "+cluster.partitions.xp={gpu_type: t4, nodes: 2, gpus_per_node: 4}",
            "cluster.partitions.t4={nodes: 3}",
        ]
    )
    assert list(run.cluster.partitions) == ["a100", "v100", "t4", "xp"]
    xp = run.cluster.partitions["xp"]
    assert (xp.partition, xp.gpu_type, xp.nodes, xp.gpus_per_node) == ("xp", "t4", 2, 4)
    assert run.cluster.partitions["t4"].nodes == 3
    with pytest.raises(ConfigError, match=r"cluster\.partitions\.xp\.nodes=0 is invalid"):
        compose_run_config(["cluster=mixed", "+cluster.partitions.xp={nodes: 0}"])
    with pytest.raises(ConfigError, match=r"did you mean nodes"):
        compose_run_config(["cluster=mixed", "+cluster.partitions.xp={nodez: 2}"])
    with pytest.raises(ConfigError, match=r"cluster=local has no partitions"):
        compose_run_config(["+cluster.partitions.xp={nodes: 2}"])
    for value in ("5", "abc", "[1,2]", "null", ""):
        with pytest.raises(
            ConfigError,
            match=rf"^cluster\.partitions\.xp={re.escape(value)} is "
            r"not a partition: give its fields in braces",
        ):
            compose_run_config(["cluster=mixed", f"+cluster.partitions.xp={value}"])


def test_a_moved_key_in_a_yaml_file_names_its_new_place(tmp_path):
    from hetseq_hpc.config import CONF_DIR

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    mixed = conf / "cluster" / "mixed.yaml"
    mixed.write_text(
        mixed.read_text().replace(
            "    partition: a100\n", "    partition: a100\n    precision: fp16\n", 1
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"cluster\.partitions\.a100\.precision is now "
        r"precision\.partitions\.a100",
    ):
        compose_run_config(["cluster=mixed"], config_dir=conf)


def test_a_whole_partition_and_its_fields_cannot_be_mixed_or_swept():
    with pytest.raises(
        ConfigError,
        match=r"given whole .* and again by "
        r"cluster\.partitions\.xp\.nodes=3",
    ):
        compose_run_config(
            [
                "cluster=mixed",
                "+cluster.partitions.xp={gpu_type: t4}",
                "cluster.partitions.xp.nodes=3",
            ]
        )
    with pytest.raises(ConfigError, match=r"cannot be swept"):
        compose_run_config(["cluster=mixed", "+cluster.partitions.xp={nodes: 1},{nodes: 2}"])


def test_resume_merges_a_whole_partition_into_the_saved_one():
    """A run directory started with +cluster.partitions.xp={gpu_type: t4, ...}, continued with
    +cluster.partitions.xp={nodes: 3}: the saved GPU type and GPUs per node stay."""
    from omegaconf import OmegaConf

    from hetseq_hpc.cli.resume import merge_overrides

    first = compose_run_config(
        ["cluster=mixed", "+cluster.partitions.xp={gpu_type: t4, nodes: 2, gpus_per_node: 4}"]
    )
    saved = OmegaConf.structured(first)
    merged = merge_overrides(saved, ["+cluster.partitions.xp={nodes: 3}"], ["cluster=mixed"])
    xp = merged.cluster.partitions.xp
    assert (xp.gpu_type, xp.nodes, xp.gpus_per_node) == ("t4", 3, 4)


def test_a_saved_config_with_a_group_that_is_not_a_mapping_is_one_line():
    from hetseq_hpc.config.aliases import migrate_saved

    with pytest.raises(ConfigError, match=r"precision='bf16' in the saved configuration"):
        migrate_saved({"trainer": {"precision": "fp16"}, "precision": "bf16"})


@pytest.mark.parametrize(
    "overrides, names",
    [
        (
            ["cluster.ranks=2", "cluster.memory_budgets_gb=[1.0]"],
            ["cluster.memory_budgets_gb=[1.0]", "1 entries", "one budget (GiB) per rank"],
        ),
        (
            ["cluster.ranks=2", "cluster.memory_budgets_gb=[1.0,0]"],
            ["cluster.memory_budgets_gb contains 0", "> 0"],
        ),
        (
            [
                "cluster.ranks=2",
                "cluster.memory_budgets_gb=[1.0,2.0]",
                "cluster.memory_budget_gb=1",
            ],
            ["cluster.memory_budgets_gb", "cluster.memory_budget_gb=1.0", "keep one"],
        ),
    ],
)
def test_per_rank_memory_budgets_are_checked_in_one_line(overrides, names):
    with pytest.raises(ConfigError) as info:
        compose_run_config(overrides)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    run = compose_run_config(["cluster.ranks=2", "cluster.memory_budgets_gb=[0.5,4]"])
    assert list(run.cluster.memory_budgets_gb) == [0.5, 4.0]


#: groups whose every option has the one schema RunConfig already types them with
SINGLE_SCHEMA_GROUPS = ("trainer", "optim", "balance", "comm", "precision", "sharding", "plan")


def test_single_schema_groups_merge_into_run_schema_without_loading_it_again():
    """conf/config.yaml starts from run_schema, which types these groups; a group file that
    names its schema again loads and merges the same dataclass a second time (half of a
    composition's CPU before issue 41). The composed node keeps its schema's type."""
    named = [
        f"{group}/{path.name}"
        for group in SINGLE_SCHEMA_GROUPS
        for path in sorted((hetseq_hpc.config.CONF_DIR / group).glob("*.yaml"))
        if "_schema" in path.read_text()
    ]
    assert not named, f"these group files name their schema again: {named}"
    cfg = compose_run(["optim=finetune", "precision=bf16", "sharding=fsdp"])
    types = {group: OmegaConf.get_type(cfg, group) for group in SINGLE_SCHEMA_GROUPS}
    assert types == {
        "trainer": TrainerConfig,
        "optim": OptimConfig,
        "balance": BalanceConfig,
        "comm": CommConfig,
        "precision": PrecisionConfig,
        "sharding": ShardingConfig,
        "plan": PlanConfig,
    }
    with pytest.raises(ConfigError, match=r"sharding\.bogus is not a setting"):
        compose_run(["sharding=fsdp", "sharding.bogus=1"])


def test_a_users_group_file_that_names_its_schema_still_composes(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(hetseq_hpc.config.CONF_DIR, conf)
    (conf / "trainer" / "mine.yaml").write_text(
        "defaults:\n  - trainer_schema\n  - _self_\nmax_steps: 7\n"
    )
    cfg = compose_run(["trainer=mine"], config_dir=conf)
    assert cfg.trainer.max_steps == 7
    assert OmegaConf.get_type(cfg, "trainer") is TrainerConfig
