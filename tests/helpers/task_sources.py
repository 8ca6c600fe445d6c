"""Sources of users' task modules that the tests write into a folder and name with
``task=custom task.target=<module>.<Class> task.path=<folder>``."""

from __future__ import annotations

from pathlib import Path

#: the data of both regression tasks below: y = x . w + noise, 224 train and 32 val samples,
#: one loss unit per sample
REGRESSION_DATA = """
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
"""

#: ``breaches.py``: a correct regression task and three that break the task contract
BREACHES = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from hetseq_hpc.tasks import Task


class Regression(Task):
    """A correct task: sum of squared errors over samples, one unit per sample."""

{regression_data}
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
'''.replace("{regression_data}", REGRESSION_DATA.lstrip("\n"))

#: ``my_tasks.py``: a regression task whose model has BatchNorm when ``task.args.batchnorm``
USER_TASK = '''
import torch
from torch import nn
from hetseq_hpc.tasks import Task


class Regression(Task):
    """y = x . w + noise; loss units are samples; the model optionally has BatchNorm."""

{regression_data}
    def build_model(self):
        norm = nn.BatchNorm1d(8) if self.cfg.args.get("batchnorm") else nn.LayerNorm(8)
        return Net(nn.Sequential(nn.Linear(4, 8), norm, nn.ReLU(), nn.Linear(8, 1)))


class Net(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, y):
        return ((self.body(x).squeeze(1) - y) ** 2).sum()


class NotATask:
    pass
'''.replace("{regression_data}", REGRESSION_DATA.lstrip("\n"))


def module_dir(tmp_path: Path, filename: str, source: str) -> Path:
    """``tmp_path/usercode`` holding ``filename`` with ``source``: a folder for ``task.path``."""
    folder = tmp_path / "usercode"
    folder.mkdir()
    (folder / filename).write_text(source)
    return folder
