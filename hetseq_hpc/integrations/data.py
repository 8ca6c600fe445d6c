"""The training loader of an integration: ONE item per optimizer step on every rank, holding
the rank's whole share of that step's global batch as its micro-batches.

Every rank's loader has the same length (``N // B`` steps per epoch), so epochs, ``max_steps``,
validation intervals, progress bars and loggers count steps alike on every rank, whatever the
split. The positions of step ``k`` come from :class:`~hetseq_hpc.integrations.engine.GlobalOrder`
and the split in effect for ``k`` (:class:`~hetseq_hpc.integrations.engine.SplitSchedule`);
the batch sampler runs in the main process, so a re-balanced split reaches the loader at the
batch the ranks agreed on, and the user's ``collate_fn`` and worker processes build the
micro-batches as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.dataloader import default_collate

from hetseq_hpc.errors import ConfigError
from hetseq_hpc.integrations.engine import GlobalOrder, SplitSchedule


class StepBatch(dict):
    """One optimizer step of one rank: ``micro_batches`` (the user's batches, collated by its
    ``collate_fn``), ``sizes`` (samples of each) and ``step`` (the 0-based global batch index).
    A ``dict`` so that Lightning's input conversion and device transfer reach the tensors."""

    @property
    def micro_batches(self) -> List[Any]:
        """The rank's micro-batches of this step, in order."""
        return self["micro_batches"]

    @property
    def sizes(self) -> List[int]:
        """Samples in each micro-batch."""
        return self["sizes"]

    @property
    def index(self) -> int:
        """0-based global batch index (the step before this one's global step count)."""
        return int(self["step"])


@dataclass(frozen=True)
class LoaderSpec:
    """What the user's training ``DataLoader`` says, for the step loader built from it.

    Attributes:
        dataset: the map-style dataset.
        collate_fn: the user's collate function (``default_collate`` when it had none).
        shuffle: reshuffle every epoch (a ``RandomSampler``, or the ``DistributedSampler``
            a framework injected; a ``SequentialSampler`` keeps the dataset order).
        seed: the shuffle's seed (the injected sampler's, else the one given).
        loader_kwargs: ``num_workers``, ``pin_memory`` and the other worker settings, as given.
    """

    dataset: Dataset
    collate_fn: Callable[[List[Any]], Any]
    shuffle: bool
    seed: int
    loader_kwargs: Dict[str, Any]


#: DataLoader settings the step loader keeps from the user's loader
KEPT_LOADER_KWARGS = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def loader_spec(loader: Any, seed: int, what: str = "train_dataloader") -> LoaderSpec:
    """Read a training ``DataLoader``.

    Raises:
        ConfigError: not a ``DataLoader``, an iterable dataset, or a sampler / batch sampler of
            the user's own (the rank's share of each global batch is cut by hetseq_hpc; one
            line naming the fix).
    """
    if not isinstance(loader, DataLoader):
        raise ConfigError(
            f"{what} returned a {type(loader).__name__}, not a torch DataLoader: uneven exact "
            "batches need a DataLoader over a map-style dataset (len() and [i])"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError(
            f"{what} reads an IterableDataset ({type(loader.dataset).__name__}): uneven exact "
            "batches cut each global batch by position; give a map-style dataset (len() and [i])"
        )
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        shuffle, seed = bool(sampler.shuffle), int(sampler.seed)
    elif isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            raise ConfigError(
                f"{what} samples with replacement or a num_samples: uneven exact batches visit "
                "the dataset as permutations; use DataLoader(shuffle=True) or a Subset"
            )
        shuffle = True
    elif isinstance(sampler, SequentialSampler):
        shuffle = False
    else:
        raise ConfigError(
            f"{what} has its own sampler ({type(sampler).__name__}): hetseq_hpc cuts every "
            "rank's share of each global batch itself; use shuffle=True/False, or a Subset of "
            "the dataset"
        )
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler).__name__ != "BatchSampler":
        raise ConfigError(
            f"{what} has its own batch_sampler ({type(batch_sampler).__name__}): the batch of "
            "each step is global_batch_size, cut per rank by hetseq_hpc; use batch_size= "
            "(ignored) with shuffle=True/False"
        )
    kwargs = {name: getattr(loader, name) for name in KEPT_LOADER_KWARGS if hasattr(loader, name)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return LoaderSpec(
        dataset=loader.dataset,
        collate_fn=loader.collate_fn or default_collate,
        shuffle=shuffle,
        seed=int(seed),
        loader_kwargs=kwargs,
    )


def lookahead(loader_kwargs: Dict[str, Any]) -> int:
    """Global batches a loader may have cut beyond the one being trained: the index batches
    its worker processes hold ahead (``num_workers x prefetch_factor``), 0 without workers."""
    workers = int(loader_kwargs.get("num_workers") or 0)
    if workers <= 0:
        return 0
    return workers * int(loader_kwargs.get("prefetch_factor") or 2)


@dataclass(frozen=True)
class StepHeader:
    """The first key of a step's index batch: the step and its micro-batch sizes."""

    step: int
    sizes: Tuple[int, ...]


class PositionItems(Dataset):
    """The user's dataset as the step loader reads it: a dataset position gives
    ``dataset[position]``, a :class:`StepHeader` gives itself (runs in the loader's workers)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, StepHeader):
            return key
        return self.dataset[key]


class StepCollate:
    """Cuts a step's items (its :class:`StepHeader` first) into its micro-batches and collates
    each with the user's ``collate_fn``: a :class:`StepBatch`."""

    def __init__(self, collate_fn: Callable[[List[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, items: Sequence[Any]) -> StepBatch:
        header, rest = items[0], list(items[1:])
        micro, at = [], 0
        for size in header.sizes:
            micro.append(self.collate_fn(rest[at : at + size]))
            at += size
        return StepBatch(micro_batches=micro, sizes=list(header.sizes), step=header.step)


class StepSampler(Sampler):
    """The batch sampler of the step loader: for each step from ``start()`` on, a
    :class:`StepHeader` and the positions of this rank's micro-batches (``len`` = steps per
    epoch; the framework ends the epoch by that length, and a new iterator starts at the
    global step it is made at)."""

    def __init__(
        self,
        order: GlobalOrder,
        schedule: Callable[[], Optional[SplitSchedule]],
        rank: int,
        start: Callable[[], int],
    ):
        self.order = order
        self.schedule = schedule
        self.rank = rank
        self.start = start

    def __len__(self) -> int:
        return self.order.steps_per_epoch

    def __iter__(self) -> Iterator[List[Any]]:
        index = int(self.start())
        while True:
            schedule = self.schedule()
            if schedule is None:
                raise ConfigError(
                    "the hetseq step loader was read before the ranks agreed on a split: "
                    "iterate it inside fit() (or call the helper's setup first)"
                )
            micro = schedule.micro_positions(self.order, index, self.rank)
            header = StepHeader(index, tuple(len(part) for part in micro))
            yield [header, *(int(p) for part in micro for p in part)]
            index += 1


class StepLoader(DataLoader):
    """The step loader (a ``DataLoader``): resumable in the sense frameworks ask about
    (``state_dict`` / ``load_state_dict``), since its position is the global step."""

    def state_dict(self) -> Dict[str, Any]:
        """Nothing to save: the position follows from the global step."""
        return {"position": "global step"}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`state_dict`)."""


def step_loader(
    spec: LoaderSpec,
    order: GlobalOrder,
    schedule: Callable[[], Optional[SplitSchedule]],
    rank: int,
    start: Callable[[], int],
) -> StepLoader:
    """The step loader of ``spec`` for rank ``rank`` (``start()``: the 0-based global batch a
    new iterator starts at, the framework's global step)."""
    return StepLoader(
        PositionItems(spec.dataset),
        batch_sampler=StepSampler(order, schedule, rank, start),
        collate_fn=StepCollate(spec.collate_fn),
        **spec.loader_kwargs,
    )


__all__ = [
    "LoaderSpec",
    "PositionItems",
    "StepBatch",
    "StepCollate",
    "StepHeader",
    "StepLoader",
    "StepSampler",
    "loader_spec",
    "lookahead",
    "step_loader",
]
