"""The task contract checked before step 1 (hetseq_hpc.train.contract_check), in-process on a
world-size-1 gloo group: the check restores the RNG states and the modules' modes, refuses a
breach in one line, and passes the built-in tasks and examples/char_lm.py with dropout on.
(Breaches refused by real 2-rank runs, and the guarded import of a task module:
tests/integration/test_contract_check_runs.py.)
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hetseq_hpc.config import compose_run_config
from hetseq_hpc.distributed.gang import FakeGang
from hetseq_hpc.errors import TaskContractError
from hetseq_hpc.tasks import build_task
from hetseq_hpc.train.contract_check import check_task_contract, contract_positions
from hetseq_hpc.train.task_summary import record_inexact
from tests.helpers.runs import REPO, SMALL_MODEL

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the check itself, one rank
def _built(breaches_dir: Path, target: str):
    run = compose_run_config(["task=custom", f"task.target={target}", f"task.path={breaches_dir}"])
    task = build_task(run.task, 0)
    task.load()
    torch.manual_seed(0)
    return task, task.build_model()


def _check(task, model) -> None:
    check_task_contract(task, model, torch.device("cpu"), FakeGang(), seed=0)


def test_check_restores_rng_and_modes_and_refuses_breaches_in_one_line(breaches_dir):
    task, model = _built(breaches_dir, "breaches.Regression")
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
    for target, member in (
        ("breaches.MeanLoss", r"forward\(\*\*batch\)"),
        ("breaches.CountOne", "count is not additive"),
    ):
        with pytest.raises(TaskContractError, match=member) as info:
            _check(*_built(breaches_dir, target))
        assert "\n" not in str(info.value)


def test_make_batch_from_the_global_rng_is_refused_on_one_rank(breaches_dir):
    task, model = _built(breaches_dir, "breaches.Regression")
    plain = task.make_batch

    def noisy(positions, epoch, split):
        batch = plain(positions, epoch, split)
        return {"x": batch["x"] + torch.randn_like(batch["x"]), "y": batch["y"]}

    task.make_batch = noisy
    with pytest.raises(
        TaskContractError,
        match=r"make_batch is not row-wise: 'x' of the first "
        r"half .* global RNG",
    ):
        _check(task, model)


def test_positions_are_the_start_of_the_first_global_batch():
    from hetseq_hpc.train.sampler import GlobalBatchSampler

    first = GlobalBatchSampler(100, 32, 7).global_batch(0)[1]
    assert contract_positions(100, 7) == [int(p) for p in first[:8]]
    assert len(contract_positions(3, 7)) == 3


def test_inexact_records_merge():
    info = {
        "exact": False,
        "inexact": {
            "exact": False,
            "reason": "BatchNorm",
            "batchnorm_layers": [["a", "BatchNorm1d"]],
        },
    }
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
    np.savez(
        root / "digits.npz",
        images=(digits.images * 16).clip(0, 255).astype(np.uint8),
        labels=digits.target,
    )
    pairs = sorted(
        {
            p
            for f in site_package_catalogs()
            if "django" in str(f)
            for p in read_mo(f)
            if 0 < len(p[0]) <= 60 and 0 < len(p[1]) <= 60 and p[0] != p[1]
        }
    )[:200]
    (root / "pairs.tsv").write_text("".join(f"{de}\t{en}\n" for de, en in pairs), encoding="utf-8")
    text = "\n\n".join(topics[k] for k in sorted(topics)[:40])
    (root / "text.txt").write_text(text, encoding="utf-8")
    return root


def _builtin(name: str, root: Path, cache: Path) -> list:
    if name == "bert":
        return [
            "task=bert",
            *SMALL_MODEL,
            f"task.data.files=[{root / 'text.txt'}]",
            "task.data.vocab_size=500",
            f"task.data.cache_dir={cache}",
        ]
    if name == "image":
        return [
            "task=image",
            f"task.data.path={root / 'digits.npz'}",
            "task.model.width=8",
            "task.model.num_stages=2",
            "task.model.groups=4",
            f"task.data.cache_dir={cache}",
        ]
    if name == "translation":
        return [
            "task=translation",
            f"task.data.files=[{root / 'pairs.tsv'}]",
            "task.model.d_model=32",
            "task.model.num_encoder_layers=1",
            "task.model.num_decoder_layers=1",
            "task.model.num_heads=2",
            "task.model.ff_size=64",
            "task.model.max_len=24",
            "task.data.vocab_size=300",
            f"task.data.cache_dir={cache}",
        ]
    return [
        "task=custom",
        "task.target=examples.char_lm.CharLMTask",
        "+task.args.seq_len=32",
        "+task.args.hidden=32",
        f"task.path={REPO}",
    ]


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
