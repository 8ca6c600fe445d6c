"""The image-classification task (``task=image``); loss units are samples."""

from __future__ import annotations

import logging
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from hetseq_hpc.config.tasks import ImageTaskConfig
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.tasks.cache import cache_root
from hetseq_hpc.tasks.image.data import (
    ImageArrays,
    build_image_cache,
    cache_key,
    load_image_cache,
    make_image_batch,
    resolve_source,
)
from hetseq_hpc.tasks.image.resnet import ResNetClassifier

log = logging.getLogger(__name__)


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


class ImageTask(Task):
    """Image classification with a GroupNorm ResNet; cross-entropy summed over samples.

    Args:
        cfg: the ``task`` config group (:class:`ImageTaskConfig`).
        seed: ``trainer.seed`` (augmentation seed).

    Raises:
        ConfigError / DataError: from :func:`resolve_source` when no image source is usable.
    """

    name = "image"
    unit_name = "images"

    def __init__(self, cfg: ImageTaskConfig, seed: int):
        super().__init__(cfg, seed)
        self.source = resolve_source(cfg.data.path)
        self.directory = cache_root(cfg.data.cache_dir) / cache_key(
            self.source, cfg.data.image_size, cfg.data.val_fraction
        )
        self._data: Optional[ImageArrays] = None
        # digits are not mirror-symmetric: no horizontal flips for the scikit-learn fallback
        self.flip = cfg.data.flip and self.source.kind != "digits"

    def prepare(self) -> None:
        """Decode the images into the cache (rank 0, before the others load)."""
        build_image_cache(
            self.source, self.cfg.data.image_size, self.cfg.data.val_fraction, self.directory
        )

    def load(self) -> None:
        """Memory-map the cached arrays (every rank) and log the source used."""
        self._data = load_image_cache(self.directory, self.cfg.data.max_val_samples)
        log.info("task=image data: %s", self.data_summary)

    @property
    def data(self) -> ImageArrays:
        """The loaded arrays; raises DataError before :meth:`load`."""
        return self.loaded(self._data)

    @property
    def data_summary(self) -> Dict[str, object]:
        """Which source was used and its size, for the log and ``summary.json``."""
        meta = self.data.meta
        return {
            "source": meta["source"],
            "train_samples": self.num_train,
            "val_samples": self.num_val,
            "image_shape": meta["shape"],
            "num_classes": meta["num_classes"],
        }

    @property
    def num_train(self) -> int:
        """Training images."""
        return int(self.data.train_x.shape[0])

    @property
    def num_val(self) -> int:
        """Validation images (at most ``task.data.max_val_samples``)."""
        return int(self.data.val_x.shape[0])

    @property
    def units_per_sample(self) -> float:
        """Loss units per sample: 1 (one label per image)."""
        return 1.0

    def build_model(self) -> ResNetClassifier:
        """A freshly initialised CNN on the CPU (seed the RNG first)."""
        meta = self.data.meta
        return ResNetClassifier(self.cfg.model, int(meta["shape"][0]), int(meta["num_classes"]))

    def make_batch(
        self, positions: Sequence[int], epoch: int, split: str
    ) -> Dict[str, torch.Tensor]:
        """``{"images": (B, C, H, W) float32, "labels": (B,) int64}``, B = ``len(positions)``;
        positions are 0-based within ``split`` ("train" or "val"). Training images are augmented
        as a function of (seed, epoch, position) only."""
        return make_image_batch(
            self.data, positions, split, self.seed, epoch, self.cfg.data.pad, self.flip
        )

    def count(self, batch: Dict[str, torch.Tensor]) -> int:
        """Samples in ``batch`` (the loss normaliser's units)."""
        return int(batch["labels"].shape[0])

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs of one image: 3x the forward FLOPs that
        ``torch.utils.flop_counter.FlopCounterMode`` counts on one zero image."""
        from torch.utils.flop_counter import FlopCounterMode

        net = _unwrap(model)
        param = next(net.parameters())
        image = torch.zeros(
            (1, *tuple(self.data.meta["shape"])), dtype=param.dtype, device=param.device
        )
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            net.logits(image)
        return 3.0 * float(counter.get_total_flops())

    @torch.no_grad()
    def evaluate_batch(
        self, model: nn.Module, batch: Dict[str, torch.Tensor], positions: Sequence[int]
    ) -> Dict[str, float]:
        """Additive validation sums of one batch: ``loss_sum``, ``correct`` (top-1) and
        ``samples``; the caller sums them over batches and ranks, then calls
        :meth:`finalize_metrics`. ``positions`` is unused here (part of the common API)."""
        net = _unwrap(model)
        logits = net.logits(batch["images"]).float()
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
        correct = (logits.argmax(dim=1) == batch["labels"]).sum()
        return {
            "loss_sum": float(loss),
            "correct": float(correct),
            "samples": float(batch["labels"].shape[0]),
        }

    def finalize_metrics(self, sums: Dict[str, float]) -> Dict[str, float]:
        """``{"val_loss": mean cross-entropy, "val_accuracy": top-1 in [0, 1]}``."""
        n = max(sums.get("samples", 0.0), 1.0)
        return {
            "val_loss": sums.get("loss_sum", 0.0) / n,
            "val_accuracy": sums.get("correct", 0.0) / n,
        }
