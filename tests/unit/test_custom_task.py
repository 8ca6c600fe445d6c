"""The public task API (hetseq_hpc.tasks.Task) and task=custom, in-process: the contract checks
(one line each), the import errors of task.target, the example task, FLOPs for any task.
(BatchNorm refused before training, and accepted with trainer.allow_inexact_batchnorm=true, in
real runs: tests/integration/test_custom_task_runs.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.errors import ConfigError, TaskContractError
from hetseq_hpc.tasks import Task, build_task
from hetseq_hpc.tasks.contract import check_loss, checked_batch, checked_count
from hetseq_hpc.tasks.custom import resolve_target
from hetseq_hpc.tasks.flops import measure_flops_per_sample, task_flops_per_sample
from tests.helpers.runs import REPO
from tests.helpers.task_sources import module_dir

EXAMPLE = "examples.char_lm.CharLMTask"


def custom_run(user_task_dir: Path, *overrides: str):
    return compose_run_config(
        ["task=custom", "task.target=my_tasks.Regression", f"task.path={user_task_dir}", *overrides]
    )


class Toy(Task):
    """A minimal in-test task whose pieces the contract tests break one at a time."""

    def load(self):
        pass

    num_train = property(lambda self: 8)
    num_val = property(lambda self: 0)

    def make_batch(self, positions, epoch, split):
        return {"x": torch.ones(len(positions), 2)}

    def count(self, batch):
        return batch["x"].shape[0]

    def build_model(self):
        return nn.Linear(2, 1)


def test_contract_errors_are_one_line_each():
    toy = Toy(None, 0)
    assert checked_count(toy, checked_batch(toy, [0, 1, 2], 0, "train")) == 3

    class WrongRows(Toy):
        def make_batch(self, positions, epoch, split):
            return {"x": torch.ones(len(positions) + 1, 2)}

    class NoUnits(Toy):
        def count(self, batch):
            return 0

    class FloatUnits(Toy):
        def count(self, batch):
            return 2.5

    cases = [
        (
            lambda: checked_batch(WrongRows(None, 0), [0, 1], 0, "train"),
            r"'x' of shape \(3, 2\) for 2 positions .* first dimension of every tensor",
        ),
        (
            lambda: checked_count(NoUnits(None, 0), {"x": torch.ones(4, 2)}),
            r"count returned 0 for a batch of 4 samples",
        ),
        (
            lambda: checked_count(FloatUnits(None, 0), {"x": torch.ones(4, 2)}),
            r"count returned 2.5: return the number of loss units",
        ),
        (
            lambda: check_loss(toy, torch.ones(3)),
            r"returned a tensor of shape \(3,\) .* 0-dim floating tensor",
        ),
        (lambda: check_loss(toy, torch.tensor(3)), r"dtype torch.int64 .* 0-dim floating tensor"),
        (lambda: check_loss(toy, 1.5), r"returned a float from forward"),
    ]
    for call, pattern in cases:
        with pytest.raises(TaskContractError, match=pattern) as info:
            call()
        assert "\n" not in str(info.value)
    assert checked_count(NoUnits(None, 0), {"x": torch.ones(0, 2)}) == 0  # empty is fine


def test_import_errors_name_the_path_and_what_was_found(user_task_dir):
    cases = [
        ("nonexistent_pkg.mod.Task", r"no module named 'nonexistent_pkg' in task.path"),
        ("examples.no_such_file.Task", r"'examples' exists but has no module 'no_such_file'"),
        (
            "examples.char_lm.CharLmTask",
            r"has no 'CharLmTask': did you mean "
            r"examples.char_lm.CharLMTask\?",
        ),
        ("my_tasks.NotATask", r"is a class that does not subclass hetseq_hpc.tasks.Task"),
        ("Regression", r"is not a dotted path"),
    ]
    for target, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as info:
            resolve_target(target, str(user_task_dir))
        assert "\n" not in str(info.value) and repr(target) in str(info.value)
    with pytest.raises(ConfigError, match=r"^task.target is empty"):
        compose_run_config(["task=custom"])


def passes_counted(monkeypatch) -> list:
    """Record ``on_meta`` of every counted pass of :mod:`hetseq_hpc.tasks.flops` (the real
    function still runs): which path gave the count."""
    from hetseq_hpc.tasks import flops

    seen, real = [], flops._counted_pass

    def spy(task, model, batch, on_meta):
        seen.append(on_meta)
        return real(task, model, batch, on_meta)

    monkeypatch.setattr(flops, "_counted_pass", spy)
    return seen


def test_custom_task_is_built_with_its_config_and_seed(user_task_dir, monkeypatch):
    run = custom_run(user_task_dir, "+task.args.batchnorm=false", "trainer.seed=5")
    assert run.task.path == str(user_task_dir) and run.task.args == {"batchnorm": False}
    task = build_task(run.task, run.trainer.seed)
    assert type(task).__name__ == "Regression" and task.seed == 5 and task.cfg is run.task
    task.load()
    torch.manual_seed(0)
    model = task.build_model()
    # no formula: measured with FlopCounterMode. Forward 2 * (4*8 + 8*1) = 80 per sample;
    # backward: both gradients of the second layer (2 * 2 * 8 = 32) and only the weight
    # gradient of the first (2 * 4 * 8 = 64; its input needs none): 176 in all
    assert task.flops_per_sample(model) is None
    assert task_flops_per_sample(task, model) == 176.0
    assert all(p.grad is None for p in model.parameters())
    # the planner's count on meta tensors: the same operators, so the same FLOPs, and the
    # model's own weights are neither moved nor given gradients
    weights = [p.detach().clone() for p in model.parameters()]
    passes = passes_counted(monkeypatch)
    assert task_flops_per_sample(task, model, on_meta=True) == 176.0
    assert passes == [True]  # counted on meta alone
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    metrics = task.finalize_metrics(
        task.evaluate_batch(model, task.make_batch([0, 1], 0, "val"), [0, 1])
    )
    assert set(metrics) == {"val_loss", "val_ppl"}  # the default metrics


def test_a_model_that_reads_values_is_counted_on_its_own_device_not_meta(monkeypatch):
    """``.item()`` (or ``nonzero``, a branch on a tensor) cannot run on meta tensors: the
    planner's meta count falls back to the real pass and gives its FLOPs; a broken loss is
    still named by the real pass."""

    class ReadsValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x):
            scale = float(x.abs().max().item())  # a value: fails on meta
            return (self.lin(x) * scale).sum()

    class Reader(Toy):
        def build_model(self):
            return ReadsValues()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 3)

        def forward(self, x):
            return self.lin(x)  # the logits, not a 0-dim loss

    class BadLoss(Toy):
        def build_model(self):
            return Logits()

    reader = Reader(None, 0)
    model = reader.build_model()
    real = measure_flops_per_sample(reader, model)
    passes = passes_counted(monkeypatch)
    assert real > 0 and measure_flops_per_sample(reader, model, on_meta=True) == real
    assert passes == [True, False]  # meta tried, then the real pass
    bad = BadLoss(None, 0)
    with pytest.raises(TaskContractError, match=r"0-dim floating tensor"):
        measure_flops_per_sample(bad, bad.build_model(), on_meta=True)
    assert passes[2:] == [True, False]  # named by the real pass, not the meta one


def test_example_task_and_formula_tasks(tmp_path):
    run = compose_run_config(
        [
            "task=custom",
            f"task.target={EXAMPLE}",
            "+task.args.seq_len=16",
            "+task.args.hidden=16",
            f"task.path={REPO}",
        ]
    )
    task = build_task(run.task, 0)
    task.load()
    batch = task.make_batch([0, 1, 2], 0, "train")
    assert batch["inputs"].shape == (3, 16) and task.count(batch) == 48
    assert task.units_per_sample == 16.0 and task.data_summary["source"] == "pydoc_data.topics"
    torch.manual_seed(0)
    model = task.build_model()
    assert measure_flops_per_sample(task, model) > 0
    assert len(task.examples(model.eval(), 2)) == 2
    # the planner builds any task's model (from its data) and measures its FLOPs
    from hetseq_hpc.plan import measure_model

    info = measure_model(run.task, need_activations=True)
    assert info.param_count == sum(p.numel() for p in model.parameters())
    assert info.flops_per_sample == pytest.approx(measure_flops_per_sample(task, model), rel=1e-6)
    assert info.activation_bytes_per_sample > 0
    # a task with no counted architecture: memory traffic from its measured activations
    from hetseq_hpc.balance.calibrate import ACTIVATION_SAFETY
    from hetseq_hpc.plan.perf_model import accesses_from_activations

    assert info.accesses_per_sample == pytest.approx(
        accesses_from_activations(info.activation_bytes_per_sample / ACTIVATION_SAFETY)
    )
    assert info.accesses_per_sample > 0
    # its vocabulary comes from its data (a custom task has no task.data.vocab_size to name)
    assert info.vocab_size == len(task.chars) and info.vocab_from == "its data"


PLANNED_TASK = '''
import torch
from torch import nn

from hetseq_hpc.tasks import Task
from hetseq_hpc.tasks.planning import EncoderShape, PlanningModel


class Planned(Task):
    """Its data is only on the cluster: prepare and load fail on the machine that plans."""

    name = "planned"

    def prepare(self):
        raise RuntimeError("the data is not on this machine")

    def load(self):
        raise RuntimeError("the data is not on this machine")

    num_train = property(lambda self: 64)
    num_val = property(lambda self: 0)

    def make_batch(self, positions, epoch, split):
        x = torch.arange(len(positions) * 8, dtype=torch.float32).reshape(-1, 8)
        return {"x": x, "y": torch.zeros(len(positions))}

    def count(self, batch):
        return int(batch["x"].shape[0])

    def build_model(self):
        return Net()

    def flops_per_sample(self, model):
        return 48.0

    def planning_model(self, on_meta=False):
        batches = lambda n: self.make_batch(list(range(n)), 0, "train")  # noqa: E731
        shape = EncoderShape("tiny", 2, 8, 2, 4, 32, False)
        return PlanningModel(self.build_model(), batches, 0, [f"on_meta={on_meta}"], shape)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, y):
        return ((self.lin(x).squeeze(-1) - y) ** 2).sum()
'''


def test_the_planner_asks_the_task_for_its_model(tmp_path):
    """The planner sizes every task through Task.planning_model: a task whose data is not on
    the planning machine plans from its own model and batches (never prepare or load), and the
    encoder shape it gives is what the memory traffic is counted from."""
    from hetseq_hpc.plan import measure_model
    from hetseq_hpc.plan.perf_model import transformer_accesses

    folder = module_dir(tmp_path, "planned.py", PLANNED_TASK)
    run = compose_run_config(["task=custom", "task.target=planned.Planned", f"task.path={folder}"])
    size = measure_model(run.task, need_activations=False)
    assert size.param_count == 9 and size.flops_per_sample == 48.0
    assert size.notes == ["on_meta=True"] and size.activation_bytes_per_sample == 0
    assert size.accesses_per_sample == transformer_accesses(2, 8, 2, 4, 32)
    assert size.accesses_from == "counted from the tiny shape"
    measured = measure_model(run.task, need_activations=True)
    assert measured.notes == ["on_meta=False"] and measured.activation_bytes_per_sample > 0
