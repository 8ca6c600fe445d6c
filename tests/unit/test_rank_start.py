"""``cluster.rank_start``: which runs fork their ranks from the rank template, which exec them,
and the one-line refusals (docs/design/rank-template.md). The GPU count is faked where a GPU is
named (no GPU on this machine)."""

from __future__ import annotations

import pytest

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.launch import local


@pytest.mark.parametrize(
    "overrides, gpus, mode",
    [
        ([], 0, "fork"),  # the embedded default on a CPU-only machine
        (["cluster.rank_start=fork"], 0, "fork"),
        (["cluster.rank_start=exec"], 0, "exec"),
        (["cluster.devices=[cpu,cpu]"], 1, "fork"),  # a GPU is there, but no rank uses it
        (["cluster.ranks=1"], 1, "exec"),  # the rank is on the GPU
        (["cluster.devices=[cuda,cpu]"], 1, "exec"),
        (["cluster.command=[python,train.py]"], 0, "exec"),  # the user's own program
    ],
)
def test_auto_forks_cpu_ranks_of_the_worker_only_fake_gpu_count(overrides, gpus, mode, monkeypatch):
    monkeypatch.setattr("hetseq_hpc.config.validate.visible_gpu_count", lambda: gpus)
    assert local.rank_start_mode(compose_run_config(overrides), gpus=gpus) == mode


@pytest.mark.parametrize(
    "overrides, gpus, words",
    [
        (["cluster.rank_start=fork", "cluster.ranks=1"], 1, "GPU"),
        (["cluster.rank_start=fork", "cluster.devices=[cuda,cpu]"], 1, "GPU"),
        (["cluster.rank_start=fork", "cluster.command=[python,train.py]"], 0, "cluster.command"),
    ],
)
def test_fork_where_it_is_unsafe_is_one_line_with_the_fix_fake_gpu_count(
    overrides, gpus, words, monkeypatch
):
    monkeypatch.setattr("hetseq_hpc.config.validate.visible_gpu_count", lambda: gpus)
    with pytest.raises(ConfigError) as err:
        local.rank_start_mode(compose_run_config(overrides), gpus=gpus)
    text = str(err.value)
    assert "\n" not in text and words in text and "cluster.rank_start=auto" in text


def test_an_unknown_rank_start_names_the_value_and_the_choices():
    with pytest.raises(ConfigError) as err:
        compose_run_config(["cluster.rank_start=spawn"])
    text = str(err.value)
    assert "cluster.rank_start='spawn'" in text and "auto, fork, exec" in text


def test_the_template_imports_what_the_tasks_ranks_import(monkeypatch, tmp_path):
    """A task config's ``rank_imports`` (task=hf: transformers) go to the template as
    ``--preload``, the worker's own imports as ``--imports-of``: imported once there instead
    of in every rank; other tasks name none, and a user's ``cluster.command`` gets neither."""
    from hetseq_hpc.config.hf_tasks import HfTaskConfig

    run = compose_run_config(["task=bert"])
    worker = ["--imports-of", local.WORKER_MODULE]
    assert local.template_words(run, tmp_path) == ["--run-dir", str(tmp_path), *worker]
    assert "transformers" in HfTaskConfig.rank_imports
    monkeypatch.setattr(type(run.task), "rank_imports", ("json", "wave"), raising=False)
    words = local.template_words(run, tmp_path)
    assert words == ["--run-dir", str(tmp_path), "--preload", "json,wave", *worker]
    command = compose_run_config(["task=bert", "cluster.command=[python,train.py]"])
    assert "--imports-of" not in local.template_words(command, tmp_path)


def test_a_template_reads_a_modules_top_level_imports_without_running_it(tmp_path, monkeypatch):
    """``--imports-of MODULE``: the ``import``/``from ... import`` statements at the top of its
    source, once each, in order; not those in functions, ``if`` blocks or relative ones; a
    module that cannot be found or parsed names none (the rank imports as it would)."""
    from hetseq_hpc.launch.template import module_imports, preload_words

    (tmp_path / "ranky.py").write_text(
        "from __future__ import annotations\n"
        "import json, wave\n"
        "from typing import TYPE_CHECKING\n"
        "from json import dumps\n"
        "if TYPE_CHECKING:\n    import fractions\n"
        "def f():\n    import decimal\n"
    )
    (tmp_path / "broken.py").write_text("import json\ndef (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_imports("ranky") == ["json", "wave", "typing"]
    assert module_imports("broken") == []
    assert module_imports("no_such_module_here") == []
    assert preload_words(["--run-dir", "x", "--preload", "a,b", "--imports-of", "ranky"]) == [
        "a",
        "b",
        "json",
        "wave",
        "typing",
    ]
    assert preload_words(["--run-dir", "x", "--imports-of"]) == []
    worker = module_imports(local.WORKER_MODULE)
    assert "torch" in worker and "hetseq_hpc.config" in worker
