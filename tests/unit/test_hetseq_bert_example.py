"""examples/hetseq_bert.py, in-process: HetSeq's own BERT as a user task. Its options fail in one
line naming ``task.args.*``; its loss is a SUM over masked tokens (what makes uneven batches
exact; the real 1-rank vs 2-uneven-ranks run with a resume is in
tests/integration/test_tasks_exact.py); its masked-LM head runs on every position, as
HetSeq's does (the planner check: tests/unit/test_plan_hetseq.py)."""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.tasks import build_task
from hetseq_hpc.tasks.bert.mlm_data import IGNORE_INDEX
from hetseq_hpc.tasks.contract import checked_batch, checked_count
from hetseq_hpc.tasks.flops import measure_flops_per_sample, task_flops_per_sample
from tests.helpers.runs import REPO

TINY = [
    "+task.args.hidden_size=32",
    "+task.args.num_layers=1",
    "+task.args.num_heads=2",
    "+task.args.intermediate_size=64",
    "+task.args.max_seq_len=32",
    "+task.args.vocab_size=1000",
    "+task.args.data_vocab_size=1000",
]


def _task(cache, *overrides: str):
    run = compose_run_config(
        [
            "task=custom",
            "task.target=examples.hetseq_bert.HetSeqBertTask",
            f"task.path={REPO}",
            f"+task.args.cache_dir={cache}",
            *overrides,
        ]
    )
    return build_task(run.task, seed=0)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+task.args.hiden_size=64",
            "task.args.hiden_size is not an option of HetSeqBertTask: use one",
        ),
        (
            "+task.args.num_heads=5",
            "task.args.num_heads=5 does not divide task.args.hidden_size=768",
        ),
        ("+task.args.hidden_size=abc", "task.args.hidden_size='abc' is not a whole number"),
        ("+task.args.data_vocab_size=10", "task.args.data_vocab_size=10 is too small"),
        ("task.model.dropout=2", "task.model.dropout=2.0 is invalid"),
        ("task.model.dropout=abc", "task.model.dropout='abc' is not a number"),
        (
            "+task.args.vocab_size=500",
            "task.args.vocab_size=500 is below the data's vocabulary (8192)",
        ),
    ],
)
def test_a_bad_option_is_one_line_naming_it(token_cache, override, message):
    with pytest.raises(ConfigError) as info:
        _task(token_cache, override)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def loaded(token_cache):
    task = _task(token_cache, *TINY, "task.model.dropout=0.0")
    task.prepare()
    task.load()
    torch.manual_seed(0)
    return task, task.build_model().eval()


def test_the_loss_is_a_sum_over_masked_tokens(loaded):
    """Two halves' losses add up to the whole batch's, and the count is the masked tokens."""
    task, model = loaded
    batch = checked_batch(task, list(range(6)), 0, "train")
    halves = [
        checked_batch(task, list(range(3)), 0, "train"),
        checked_batch(task, list(range(3, 6)), 0, "train"),
    ]
    with torch.no_grad():
        whole = model(**batch)
        parts = sum(model(**h) for h in halves)
    assert whole.item() == pytest.approx(parts.item(), rel=1e-5)
    assert checked_count(task, batch) == int((batch["labels"] != IGNORE_INDEX).sum()) > 0
    assert task.data_summary["model_vocab_size"] == 1000 and task.data_summary["seq_len"] == 32


def test_the_head_runs_on_every_position(loaded):
    """Counted FLOPs: the vocabulary projection of all 32 positions (HetSeq's head), not of the
    masked ones only; ``flops_per_sample`` leaves the count to ``FlopCounterMode``."""
    task, model = loaded
    assert task.flops_per_sample(model) is None
    measured = measure_flops_per_sample(task, model)
    assert task_flops_per_sample(task, model) == pytest.approx(measured)
    h, inter, vocab, t = 32, 64, 1000, 32
    encoder = 2 * (4 * h * h + 2 * h * inter) * t + 4 * t * t * h
    head = 2 * (h * h + h * vocab) * t
    assert measured == pytest.approx(3 * (encoder + head), rel=0.01)
