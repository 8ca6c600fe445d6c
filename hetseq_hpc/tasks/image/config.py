"""Schema of ``task=image`` (same style as :mod:`hetseq_hpc.config.schema`; not registered yet)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hetseq_hpc.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class ImageModelConfig:
    """Size of the ResNet-style CNN (He et al., 2016) with GroupNorm (Wu & He, 2018)."""

    # channels of the first stage; each later stage doubles them
    width: int = 16
    # stages; every stage after the first halves the spatial size
    num_stages: int = 3
    # residual blocks per stage
    blocks_per_stage: int = 1
    # GroupNorm groups (must divide width); BatchNorm is not used: it breaks exact uneven batches
    groups: int = 8
    # dropout before the classifier; 0.0 makes runs bit-comparable
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("width", "num_stages", "blocks_per_stage", "groups"):
            value = getattr(self, name)
            _require(value >= 1, f"task.model.{name}={value} is invalid: it must be >= 1")
        _require(
            self.width % self.groups == 0,
            f"task.model.groups={self.groups} does not divide task.model.width={self.width}: "
            "choose groups that divide the width (e.g. 8 for width 16)",
        )
        _require(
            0.0 <= self.dropout < 1.0,
            f"task.model.dropout={self.dropout} is invalid: it must be in [0, 1)",
        )


@dataclass
class ImageDataConfig:
    """Where the images come from and how they are augmented."""

    # a folder with one sub-folder per class, or an .npz with `images`/`labels`; null = built-in
    # (Debian dataset-fashion-mnist, else scikit-learn's digits)
    path: Optional[str] = None
    # resize every image to this many pixels square; null = keep the source's size
    image_size: Optional[int] = None
    # share of the images held out for validation (sources without their own test split)
    val_fraction: float = 0.1
    # validation images used at most (the first ones of the fixed split); 0 = all
    max_val_samples: int = 2000
    # random-crop padding in pixels for training images; 0 = no crop
    pad: int = 2
    # random horizontal flips of training images (turn off for digits or text)
    flip: bool = True
    # where decoded image arrays are cached; null = ~/.cache/hetseq_hpc
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.image_size is not None:
            _require(
                4 <= self.image_size <= 512,
                f"task.data.image_size={self.image_size} is invalid: use 4..512 pixels, or null",
            )
        _require(
            0.0 < self.val_fraction < 0.5,
            f"task.data.val_fraction={self.val_fraction} is invalid: it must be in (0, 0.5)",
        )
        _require(
            self.max_val_samples >= 0,
            f"task.data.max_val_samples={self.max_val_samples} is invalid: use >= 0 (0 = all)",
        )
        _require(
            0 <= self.pad <= 16,
            f"task.data.pad={self.pad} is invalid: use 0..16 pixels (0 = no random crop)",
        )


@dataclass
class ImageTaskConfig:
    """Image classification: top-1 accuracy, cross-entropy summed over samples."""

    name: str = "image"
    model: ImageModelConfig = field(default_factory=ImageModelConfig)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)
