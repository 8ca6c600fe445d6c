"""The planner sizes BERT's embeddings from the prepared tokenizer when ``prepare`` already ran:
``task.data.vocab_size`` is only a ceiling (the built-in corpus trains 4,320 of 8,192 tokens, so
the planner counted 51 % more gradient bytes than a run all-reduces; found by
scripts/bench_network.py against measured all-reduce times, issue 46)."""

from __future__ import annotations

import json

from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.plan.model_info import vocab_source
from hetseq_hpc.tasks import build_task


def _task(tmp_path):
    run = compose_run_config([f"task.data.cache_dir={tmp_path}"])
    return run.task, build_task(run.task, 0)


def test_before_prepare_the_ceiling_is_planned(tmp_path):
    cfg, task = _task(tmp_path)
    planned = task.planning_model(on_meta=True)
    assert planned.vocab_size == cfg.data.vocab_size == 8192
    assert vocab_source(cfg, planned.vocab_size) == "task.data.vocab_size"


def test_after_prepare_the_tokenizers_vocabulary_is_planned(tmp_path):
    cfg, task = _task(tmp_path)
    task.directory.mkdir(parents=True)
    (task.directory / "meta.json").write_text(json.dumps({"vocab_size": 4320}))
    planned = task.planning_model(on_meta=True)
    rows = {n: p.shape[0] for n, p in planned.model.named_parameters() if "word_emb" in n}
    assert planned.vocab_size == 4320 and set(rows.values()) == {4320}, rows
    assert vocab_source(cfg, 4320).startswith("its prepared tokenizer")


def test_a_damaged_meta_plans_the_ceiling(tmp_path):
    _, task = _task(tmp_path)
    task.directory.mkdir(parents=True)
    (task.directory / "meta.json").write_text("{not json")
    assert task.planning_model(on_meta=True).vocab_size == 8192
