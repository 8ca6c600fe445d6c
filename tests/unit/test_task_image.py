"""task=image on tiny real files: a 3-class image folder written with Pillow and an .npz.

Checks the task contract the trainer relies on: batch shapes, batches that depend only on
(seed, epoch, position) - identical across calls and across any cut of the positions -, the
unit count known before the forward pass, a loss that is a 0-dim SUM (a batch's loss equals the
sum over its halves), learning, validation metrics, and the errors for bad inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetseq_hpc.config.tasks import ImageDataConfig, ImageModelConfig, ImageTaskConfig
from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks.image.classify_task import ImageTask
from hetseq_hpc.tasks.image.data import FASHION_DIR, _read_idx, resolve_source
from tests.helpers.task_contract import (
    assert_model_contract,
    assert_split_invariant,
    fit,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PIL = pytest.importorskip("PIL.Image")

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}


def write_folder(root, per_class=8, size=12, odd_size=None):
    """One sub-folder per class; each image a noisy coloured square on a dark background."""
    rng = np.random.default_rng(0)
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            s = odd_size if (odd_size and i == 0) else size
            pixels = rng.integers(0, 40, size=(s, s, 3)).astype(np.uint8)
            pixels[2:-2, 2:-2] = np.clip(np.asarray(colour) + rng.integers(-20, 20, 3), 0, 255)
            PIL.fromarray(pixels, "RGB").save(root / name / f"{i}.png")
    return root


def make_task(tmp_path, path, seed=7, **data):
    cfg = ImageTaskConfig(
        model=ImageModelConfig(width=8, num_stages=2, groups=4, dropout=0.0),
        data=ImageDataConfig(
            path=str(path), cache_dir=str(tmp_path / "cache"), val_fraction=0.25, **data
        ),
    )
    task = ImageTask(cfg, seed)
    task.prepare()
    task.load()
    return task


@pytest.fixture
def task(tmp_path):
    return make_task(tmp_path, write_folder(tmp_path / "images"))


def test_folder_source_sizes_and_summary(task):
    assert task.num_train + task.num_val == 24
    assert task.num_val == 6
    summary = task.data_summary
    assert summary["source"].startswith("folder ")
    assert summary["image_shape"] == [3, 12, 12] and summary["num_classes"] == 3
    assert task.units_per_sample == task.tokens_per_sample == 1.0


def test_batch_shapes_and_count_before_forward(task):
    batch = task.make_batch([0, 3, 5], epoch=0, split="train")
    assert batch["images"].shape == (3, 3, 12, 12) and batch["images"].dtype == torch.float32
    assert batch["labels"].shape == (3,) and batch["labels"].dtype == torch.int64
    assert task.count(batch) == 3  # no model involved: known before the forward pass
    assert task.make_batch([], 0, "train")["images"].shape == (0, 3, 12, 12)


def test_batches_depend_only_on_seed_epoch_position(task, tmp_path):
    positions = [5, 0, 11, 3, 17, 8]
    assert_split_invariant(task, positions, epoch=2, cut=3)
    whole = task.make_batch(positions, 2, "train")
    # augmentation changes with the epoch (crop/flip are random per epoch), labels do not
    other_epoch = task.make_batch(positions, 3, "train")
    assert not torch.equal(whole["images"], other_epoch["images"])
    assert torch.equal(whole["labels"], other_epoch["labels"])
    # validation images are never augmented
    assert torch.equal(
        task.make_batch([1, 2], 0, "val")["images"], task.make_batch([1, 2], 9, "val")["images"]
    )
    # a second task object (another rank) with the same seed builds the same batch
    twin = ImageTask(task.cfg, task.seed)
    twin.load()
    assert torch.equal(twin.make_batch(positions, 2, "train")["images"], whole["images"])


def test_loss_is_a_zero_dim_sum_over_samples(task):
    assert_model_contract(task, 8)


def test_a_few_steps_reduce_the_loss(task):
    torch.manual_seed(0)
    losses = fit(task, task.build_model(), range(12), steps=15, lr=3e-3)
    assert losses[-1] < 0.7 * losses[0]


def test_validation_metrics_add_up(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    sums = {}
    for part in ([0, 1, 2], [3, 4, 5]):
        for key, value in task.evaluate_batch(model, task.make_batch(part, 0, "val"), part).items():
            sums[key] = sums.get(key, 0.0) + value
    metrics = task.finalize_metrics(sums)
    assert sums["samples"] == 6.0
    assert 0.0 <= metrics["val_accuracy"] <= 1.0
    with torch.no_grad():
        full = model(**task.make_batch(list(range(6)), 0, "val"))
    assert metrics["val_loss"] == pytest.approx(float(full) / 6, rel=1e-5)


def test_npz_source_grey_images(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(10, 9, 9), dtype=np.uint8)
    labels = np.array([3, 7] * 5)
    np.savez(tmp_path / "set.npz", images=images, labels=labels)
    task = make_task(tmp_path, tmp_path / "set.npz", image_size=8)
    assert task.data.meta["shape"] == [1, 8, 8] and task.data.meta["num_classes"] == 2
    batch = task.make_batch([0, 1], 0, "train")
    assert batch["images"].shape == (2, 1, 8, 8) and set(batch["labels"].tolist()) <= {0, 1}


def test_bad_paths_and_sizes_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.data\.path='.*nowhere' is neither"):
        resolve_source(str(tmp_path / "nowhere"))
    write_folder(tmp_path / "mixed", per_class=2, odd_size=10)
    with pytest.raises(ConfigError, match=r"task\.data\.image_size=32"):
        make_task(tmp_path, tmp_path / "mixed")
    resized = make_task(tmp_path, tmp_path / "mixed", image_size=16)
    assert resized.data.meta["shape"] == [3, 16, 16]


def test_config_checks_name_the_field():
    with pytest.raises(
        ConfigError, match=r"^task.model.groups=3 does not divide task.model.width=16"
    ):
        ImageModelConfig(groups=3)
    with pytest.raises(ConfigError, match=r"^task.model.dropout=1.5 is invalid"):
        ImageModelConfig(dropout=1.5)
    with pytest.raises(ConfigError, match=r"^task.data.pad=-1 is invalid"):
        ImageDataConfig(pad=-1)


@pytest.mark.skipif(
    not (FASHION_DIR / "t10k-labels-idx1-ubyte.gz").is_file(),
    reason="Debian dataset-fashion-mnist is not installed",
)
def test_fashion_mnist_is_the_default_when_installed():
    assert resolve_source(None).kind == "fashion_mnist"
    labels = _read_idx(FASHION_DIR / "t10k-labels-idx1-ubyte.gz", 8)
    assert labels.shape == (10000,) and set(np.unique(labels)) == set(range(10))


def test_fresh_machine_falls_back_to_scikit_learn_digits(tmp_path, monkeypatch):
    """Without Debian's dataset-fashion-mnist (a fresh machine) the default is scikit-learn's
    digits (a dependency of hetseq_hpc: real scanned digits inside the wheel), and the data
    summary says so; without scikit-learn too, one line says what to install."""
    from hetseq_hpc.tasks.image import data as image_data

    monkeypatch.setattr(image_data, "FASHION_DIR", tmp_path / "no-fashion-mnist")
    source = resolve_source(None)
    assert source.kind == "digits"
    cfg = ImageTaskConfig(
        model=ImageModelConfig(width=8, num_stages=2, groups=4),
        data=ImageDataConfig(cache_dir=str(tmp_path / "cache")),
    )
    task = ImageTask(cfg, 0)
    task.prepare()
    task.load()
    summary = task.data_summary
    assert summary["source"] == "scikit-learn load_digits()"
    assert summary["image_shape"] == [1, 8, 8] and summary["num_classes"] == 10
    assert summary["train_samples"] + summary["val_samples"] == 1797
    assert task.flip is False  # digits are not mirror-symmetric
    monkeypatch.setitem(__import__("sys").modules, "sklearn", None)  # not installed
    with pytest.raises(DataError, match=r"pip install scikit-learn, or set task.data.path"):
        resolve_source(None)


def test_data_before_load_is_a_one_line_error(task):
    """The shared guard in Task.loaded: a task whose load() has not run names itself."""
    fresh = ImageTask(task.cfg, task.seed)
    with pytest.raises(DataError, match=r"^image data used before load\(\)"):
        _ = fresh.num_train
