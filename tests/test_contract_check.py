"""The task contract checked before step 1 (hetseq_hpc.train.contract_check) and the guarded
import of a task module (hetseq_hpc.tasks.custom).

A task that breaks the contract would train silently wrong with uneven batches: a model that
returns the MEAN loss, a count() of 1 per batch, a make_batch whose rows depend on the rank.
Each is refused by a real 2-rank run before step 1, in one line naming the member. The built-in
tasks and examples/char_lm.py pass the same check; trainer.skip_contract_check=true trains and
records the run as inexact. A task module that exits, has a syntax error or raises while being
imported is refused in one line with its file and line.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from task_contract import one_thread  # noqa: F401  (autouse: one intra-op thread)

from conftest import REPO, SMALL_MODEL, cli_env, losses
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.errors import TaskContractError
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.contract_check import check_task_contract, contract_positions
from hetseq_hpc.train.task_summary import record_inexact

TASKS = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from hetseq_hpc.tasks import Task


class Regression(Task):
    """A correct task: sum of squared errors over samples, one unit per sample."""

    def load(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(256, generator=g)

    num_train = property(lambda self: 224)
    num_val = property(lambda self: 32)

    def make_batch(self, positions, epoch, split):
        rows = torch.as_tensor(list(positions), dtype=torch.long) + (224 if split == "val" else 0)
        return {"x": self.x[rows], "y": self.y[rows]}

    def count(self, batch):
        return int(batch["y"].shape[0])

    def build_model(self):
        return Net(self.cfg.model.get("dropout", 0.0), "sum")


class MeanLoss(Regression):
    """Breach: the model returns PyTorch's default reduction, the mean."""

    def build_model(self):
        return Net(self.cfg.model.get("dropout", 0.0), "mean")


class CountOne(Regression):
    """Breach: one loss unit per batch, whatever its size."""

    def count(self, batch):
        return 1


class RankRows(Regression):
    """Breach: the rows depend on the rank that builds them."""

    def make_batch(self, positions, epoch, split):
        batch = super().make_batch(positions, epoch, split)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {"x": batch["x"] + 0.1 * rank, "y": batch["y"]}


class Net(nn.Module):
    def __init__(self, dropout, reduction):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 1))
        self.reduction = reduction

    def forward(self, x, y):
        return F.mse_loss(self.body(x).squeeze(1), y, reduction=self.reduction)
'''


@pytest.fixture
def user_dir(tmp_path) -> Path:
    folder = tmp_path / "usercode"
    folder.mkdir()
    (folder / "breaches.py").write_text(TASKS)
    return folder


def _cli(tmp_path: Path, user_dir: Path, target: str, *overrides: str, timeout: float = 300):
    cmd = [sys.executable, "-m", "hetseq_hpc", "task=custom", f"task.target={target}",
           f"task.path={user_dir}", "trainer.max_steps=2", "trainer.global_batch_size=32",
           "trainer.val_every=0", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, cwd=tmp_path, env=cli_env(tmp_path / "cache"), capture_output=True,
                          text=True, timeout=timeout)


def _metrics_rows(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


# ------------------------------------------------------------------ breaches, real 2-rank runs
@pytest.mark.slow
@pytest.mark.parametrize("target, member, pattern", [
    ("breaches.MeanLoss", "forward", r"the model of task breaches\.MeanLoss: forward\(\*\*batch\) "
     r"gave a loss of .* MEAN .* return the SUM, e\.g\. F\.cross_entropy\(.*reduction='sum'\)"),
    ("breaches.CountOne", "count", r"task breaches\.CountOne\.count is not additive: 1 for a "
     r"batch of 8 samples but 1 \+ 1 = 2 .* return the number of loss units"),
    ("breaches.RankRows", "make_batch", r"task breaches\.RankRows\.make_batch depends on the "
     r"rank: rank 1's batch of training positions \[.*\] differs from rank 0's in 'x'"),
])
def test_contract_breach_is_refused_before_step_1(tmp_path, user_dir, target, member, pattern):
    proc = _cli(tmp_path, user_dir, target, "cluster.ranks=2", "trainer.allocation=[24,8]")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # the launcher's one line
    assert last.startswith("hetseq-hpc: error: rank") and "TaskContractError" in last, last
    assert re.search(pattern, last), proc.stderr[-3000:]
    assert _metrics_rows(tmp_path / "run") == 0, "no step may run"


@pytest.mark.slow
def test_skip_contract_check_trains_and_records_inexactness(tmp_path, user_dir):
    proc = _cli(tmp_path, user_dir, "breaches.MeanLoss", "cluster.ranks=1",
                "trainer.skip_contract_check=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["exact"] is False
    assert summary["inexact"]["contract_check"] == "skipped"
    assert "trainer.skip_contract_check=true" in summary["inexact"]["reason"]
    assert _metrics_rows(tmp_path / "run") == 2
    assert "NOT known to be exact" in (tmp_path / "run" / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_the_check_changes_nothing_training_uses(tmp_path, user_dir):
    """With dropout on, the losses of every step are bit-identical with the check and without
    it (trainer.skip_contract_check=true); that the RNG states and modules' modes are restored
    is shown in-process below."""
    found = {}
    for skip in ("false", "true"):
        (tmp_path / skip).mkdir()
        proc = _cli(tmp_path / skip, user_dir, "breaches.Regression", "cluster.ranks=1",
                    "task.model.dropout=0.5",
                    f"trainer.skip_contract_check={skip}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[skip] = losses(tmp_path / skip / "run")
    assert len(found["false"]) == 2 and found["false"] == found["true"]
    assert "task contract checked on 8 training positions" in (
        tmp_path / "false" / "run" / "logs" / "rank0.log").read_text()


# ------------------------------------------------------------------ the check itself, one rank
def _built(user_dir: Path, target: str):
    run = compose_run_config(["task=custom", f"task.target={target}", f"task.path={user_dir}"])
    task = build_task(run.task, 0)
    task.load()
    torch.manual_seed(0)
    return task, task.build_model()


def _check(task, model) -> None:
    with single_process_rendezvous() as rdv:
        check_task_contract(task, model, torch.device("cpu"), rdv, seed=0)


def test_check_restores_rng_and_modes_and_refuses_breaches_in_one_line(user_dir):
    task, model = _built(user_dir, "breaches.Regression")
    model.body[2].p = 0.5  # dropout on: the check must turn it off, then restore the mode
    model.body[0].eval()  # a module the user keeps in eval stays in eval
    np.random.seed(3)
    random.seed(3)
    torch.manual_seed(3)
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    _check(task, model)
    assert torch.equal(states[0], torch.get_rng_state())
    assert np.array_equal(states[1], np.random.get_state()[1]) and states[2] == random.getstate()
    assert model.training and model.body[2].training and not model.body[0].training
    for target, member in (("breaches.MeanLoss", r"forward\(\*\*batch\)"),
                           ("breaches.CountOne", "count is not additive")):
        with pytest.raises(TaskContractError, match=member) as info:
            _check(*_built(user_dir, target))
        assert "\n" not in str(info.value)


def test_make_batch_from_the_global_rng_is_refused_on_one_rank(user_dir):
    task, model = _built(user_dir, "breaches.Regression")
    plain = task.make_batch

    def noisy(positions, epoch, split):
        batch = plain(positions, epoch, split)
        return {"x": batch["x"] + torch.randn_like(batch["x"]), "y": batch["y"]}

    task.make_batch = noisy
    with pytest.raises(TaskContractError, match=r"make_batch is not row-wise: 'x' of the first "
                       r"half .* global RNG"):
        _check(task, model)


def test_positions_are_the_start_of_the_first_global_batch():
    from hetseq_hpc.train.sampler import GlobalBatchSampler

    first = GlobalBatchSampler(100, 32, 7).global_batch(0)[1]
    assert contract_positions(100, 7) == [int(p) for p in first[:8]]
    assert len(contract_positions(3, 7)) == 3


def test_inexact_records_merge():
    info = {"exact": False, "inexact": {"exact": False, "reason": "BatchNorm",
                                        "batchnorm_layers": [["a", "BatchNorm1d"]]}}
    record_inexact(info, {"exact": False, "reason": "skipped", "contract_check": "skipped"})
    assert info["inexact"]["reason"] == "BatchNorm; skipped"
    assert info["inexact"]["batchnorm_layers"] and info["inexact"]["contract_check"] == "skipped"
    fresh = {"exact": True, "inexact": None}
    record_inexact(fresh, {"exact": False, "reason": "skipped"})
    assert fresh == {"exact": False, "inexact": {"exact": False, "reason": "skipped"}}


# ------------------------------------------------------------------ correct tasks pass
@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> dict:
    """Tiny real data: scikit-learn's digits (.npz), 200 German-English pairs of Django's
    catalogs (.tsv), and a text file of CPython's help topics for BERT."""
    from pydoc_data.topics import topics

    from sklearn.datasets import load_digits

    from hetseq_hpc.tasks.translation.parallel_corpus import read_mo, site_package_catalogs

    root = tmp_path_factory.mktemp("contract-data")
    digits = load_digits()
    np.savez(root / "digits.npz", images=(digits.images * 16).clip(0, 255).astype(np.uint8),
             labels=digits.target)
    pairs = sorted({p for f in site_package_catalogs() if "django" in str(f)
                    for p in read_mo(f) if 0 < len(p[0]) <= 60 and 0 < len(p[1]) <= 60
                    and p[0] != p[1]})[:200]
    (root / "pairs.tsv").write_text("".join(f"{de}\t{en}\n" for de, en in pairs), encoding="utf-8")
    text = "\n\n".join(topics[k] for k in sorted(topics)[:40])
    (root / "text.txt").write_text(text, encoding="utf-8")
    return root


def _builtin(name: str, root: Path, cache: Path) -> list:
    if name == "bert":
        return ["task=bert", *SMALL_MODEL, f"task.data.files=[{root / 'text.txt'}]",
                "task.data.vocab_size=500", f"task.data.cache_dir={cache}"]
    if name == "image":
        return ["task=image", f"task.data.path={root / 'digits.npz'}", "task.model.width=8",
                "task.model.num_stages=2", "task.model.groups=4", f"task.data.cache_dir={cache}"]
    if name == "translation":
        return ["task=translation", f"task.data.files=[{root / 'pairs.tsv'}]",
                "task.model.d_model=32", "task.model.num_encoder_layers=1",
                "task.model.num_decoder_layers=1", "task.model.num_heads=2",
                "task.model.ff_size=64", "task.model.max_len=24", "task.data.vocab_size=300",
                f"task.data.cache_dir={cache}"]
    return ["task=custom", "task.target=examples.char_lm.CharLMTask", "+task.args.seq_len=32",
            "+task.args.hidden=32", f"task.path={REPO}"]


@pytest.mark.parametrize("name", ["bert", "image", "translation", "char_lm"])
def test_correct_tasks_pass_with_dropout_on(name, data_files, tmp_path):
    run = compose_run_config(_builtin(name, data_files, tmp_path / "cache"))
    task = build_task(run.task, 0)
    task.prepare()
    task.load()
    torch.manual_seed(0)
    model = task.build_model()
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p > 0 for m in dropouts), "the default dropout is on"
    state = torch.get_rng_state()
    _check(task, model)  # raises on a breach
    assert torch.equal(state, torch.get_rng_state()) and model.training


# ------------------------------------------------------------------ guarded import of a task module
@pytest.mark.parametrize("source, pattern", [
    ("import sys\nsys.exit(0)\n",
     r"module 'broken' called sys\.exit\(0\) while being imported, at .*broken\.py:2: a task "
     r"module must not exit on import"),
    ("raise SystemExit\n", r"called sys\.exit\(None\) while being imported, at .*broken\.py:1"),
    ("x = 1\ndef f(:\n    pass\n",
     r"importing module 'broken' failed at .*broken\.py:2 with SyntaxError"),
    ("def check():\n    raise ValueError('no data\\nsecond line')\n\n\ncheck()\n",
     r"importing module 'broken' failed at .*broken\.py:2 with ValueError: no data: fix the "
     r"module"),
])
def test_task_module_failing_at_import_is_one_line_and_exit_2(tmp_path, source, pattern):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "broken.py").write_text(source)
    proc = subprocess.run(
        [sys.executable, "-m", "hetseq_hpc", "task=custom", "task.target=broken.Task",
         f"task.path={folder}", "cluster.ranks=1", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=cli_env(tmp_path / "cache"), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("hetseq-hpc: error: task.target='broken.Task'")
    assert re.search(pattern, lines[0]), lines[0]
    assert _metrics_rows(tmp_path / "run") == 0
