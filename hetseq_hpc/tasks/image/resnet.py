"""A small ResNet (He et al., 2016, "Deep Residual Learning") with GroupNorm (Wu & He, 2018).

GroupNorm instead of BatchNorm: it normalises each sample on its own, so the output of a sample
does not depend on which other samples share its micro-batch - the property that keeps uneven
per-rank batches exact (see :mod:`hetseq_hpc.tasks.norms`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetseq_hpc.config.tasks import ImageModelConfig


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(groups, channels), channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a residual connection (a 1x1 projection when the
    shape changes). ``(B, C_in, H, W) -> (B, C_out, H / stride, W / stride)``."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = _norm(c_out, groups)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(c_out, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block output, same layout as the input."""
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetClassifier(nn.Module):
    """``forward(images, labels) -> loss_sum``; :meth:`logits` for predictions.

    Shapes: ``images`` ``(B, C, H, W)`` float32 (any H, W >= 1: global average pooling),
    ``labels`` ``(B,)`` int64 class ids. The loss is the cross-entropy SUMMED over the B samples
    (0-dim float32); the trainer divides by the global sample count.
    """

    def __init__(self, cfg: ImageModelConfig, in_channels: int, num_classes: int):
        super().__init__()
        width = cfg.width
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            _norm(width, cfg.groups),
            nn.ReLU(),
        )
        blocks, c_in = [], width
        for stage in range(cfg.num_stages):
            c_out = width * 2**stage
            for b in range(cfg.blocks_per_stage):
                stride = 2 if stage > 0 and b == 0 else 1
                blocks.append(BasicBlock(c_in, c_out, stride, cfg.groups))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(c_in, num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> class scores ``(B, num_classes)``."""
        features = self.blocks(self.stem(images)).mean(dim=(2, 3))  # (B, C_last)
        return self.head(self.dropout(features))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """0-dim sum of cross-entropy over the batch's samples."""
        return F.cross_entropy(self.logits(images).float(), labels, reduction="sum")
