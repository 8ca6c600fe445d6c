"""How the model is spread over the ranks: a full replica per rank (DDP) or a shard (FSDP2).

The training loop talks to one of two strategies through the same methods: :class:`Replicated`
(``sharding.mode=none``: DDP with the SUM comm hook) and :class:`Sharded`
(``sharding.mode=fsdp``: FSDP2 ``fully_shard`` with a SUM reduce-scatter and the same number of
passes on every rank). Both keep "one update = one step on the whole global batch". Each
writes and reads the model and optimizer state of a checkpoint its own way (``save_state``,
``load_state``: rank 0 the whole state, or under ``sharding.checkpoint=sharded`` every rank its
shards with ``torch.distributed.checkpoint``); checkpoints of either resume on any world size
and in the other mode. Design: docs/design/sharding.md, "Replicated (DDP) or Sharded (FSDP2)".
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from hetseq_hpc.balance.allocation import RankShare
from hetseq_hpc.balance.memory import local_part, unit_bytes
from hetseq_hpc.balance.peak import MemoryWatch, peak_resident_bytes
from hetseq_hpc.config.schema import RunConfig
from hetseq_hpc.distributed.gang import Gang
from hetseq_hpc.errors import CheckpointError
from hetseq_hpc.files.fence import check_write
from hetseq_hpc.tasks.base import Task
from hetseq_hpc.train.checkpoint.manager import CheckpointManager, StateFn
from hetseq_hpc.train.checkpoint.shards import (
    load_error,
    read_metadata_safely,
    safe_reader,
    shard_dir_of,
    with_full_tensors,
)
from hetseq_hpc.train.compile import compile_in_place, compiles
from hetseq_hpc.train.ddp_hooks import HookState, no_forward_buffer_sync, sum_allreduce_hook
from hetseq_hpc.train.precision import GradientPath, fsdp_param_dtype

if TYPE_CHECKING:  # torch's DDP and FSDP2 modules are imported where they are built
    from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger(__name__)


def equal_pass_sizes(samples: int, passes: int) -> Tuple[List[int], int]:
    """Split ``samples`` into ``passes`` micro-batches as evenly as possible (larger first).

    Returns:
        ``(sizes, padding)``: ``min(samples, passes)`` sizes summing to ``samples``, and the
        number of zero-weight passes to add so that the rank runs ``passes`` passes.
    """
    real = max(1, min(int(samples), int(passes)))
    base, extra = divmod(int(samples), real)
    return [base + (1 if i < extra else 0) for i in range(real)], int(passes) - real


def activation_checkpointing(units: Sequence[nn.Module]) -> None:
    """Recompute each unit's activations in the backward pass (``torch.utils.checkpoint``,
    non-reentrant; the RNG state is restored, so dropout draws the same masks). The unit's
    ``forward`` is replaced on the instance, so parameter names (and checkpoints) do not
    change."""
    from torch.utils.checkpoint import checkpoint

    for unit in units:
        inner = unit.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner=inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        unit.forward = forward


class Replicated:
    """DDP: every rank holds the whole model; gradients are SUMMED by the comm hook.

    Args:
        model: the bare model on its device.
        device: this rank's device.
    """

    sharded = False
    mode = "ddp"
    #: the sharding units form one FSDP group (:class:`Sharded`; never under DDP)
    grouped = False
    #: this rank's :class:`~hetseq_hpc.balance.peak.MemoryWatch` (set by the worker), or None
    memory_watch: Optional[MemoryWatch] = None
    #: wrap a world of one rank in DDP too (its hooks' timings and overlap, tested in-process)
    wrap_one_rank = False

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.module: nn.Module = model
        #: whether :attr:`module` is a DDP wrapper (its comm hook marks the backward's end)
        self.wrapped = False

    def start(self, grad_path: GradientPath, hook_state: HookState) -> None:
        """Wrap in DDP (after any checkpoint was loaded into the bare model), with the SUM
        comm hook of ``grad_path`` (:class:`~hetseq_hpc.train.precision.GradientPath`) filling
        ``hook_state`` (:class:`~hetseq_hpc.train.ddp_hooks.HookState`).

        A world of one rank on the plain SUM path is not wrapped: its all-reduce is the
        identity, so the bare model computes the same gradients without DDP's buckets, copies
        and per-step bookkeeping (:attr:`wrapped` stays False; the Trainer then marks the
        backward's end itself). A compressed payload or Adasum changes the gradients even on
        one rank (a rounding, a division): those keep the wrapper and its hook. DDP's
        ``static_graph`` is not set: it breaks ``no_sync`` accumulation (docs/design/
        exact-gradients.md, "No DDP wrapper on one rank; no static_graph")."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        hook = grad_path.comm_hook(hook_state)
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        if hook is sum_allreduce_hook and alone and not self.wrap_one_rank:
            self.module, self.wrapped = self.model, False
            return
        options: Dict[str, Any] = {**no_forward_buffer_sync(), **grad_path.ddp_kwargs()}
        self.module = DDP(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            **options,
        )
        self.module.register_comm_hook(hook_state, hook)
        self.wrapped = True

    def pass_sizes(
        self, share: RankShare, all_shares: Sequence[RankShare]
    ) -> Tuple[List[int], int]:
        """This rank's micro-batch sizes and zero-weight passes: its own split, none."""
        return list(share.micro_sizes), 0

    def sync(self, last: bool) -> contextlib.AbstractContextManager:
        """All-reduce on the last pass only (nothing to hold back without the wrapper)."""
        if last or not self.wrapped:
            return contextlib.nullcontext()
        return cast("DDP", self.module).no_sync()

    def grad_norm(self, max_norm: float, grads: List[torch.Tensor]) -> float:
        """Clip the global gradient norm to ``max_norm`` (0 = no clipping); returns the norm
        (read on the host: a synchronisation on a GPU)."""
        return float(self.grad_norm_tensor(max_norm, grads))

    def grad_norm_tensor(self, max_norm: float, grads: List[torch.Tensor]) -> torch.Tensor:
        """:meth:`grad_norm` without reading it: the norm as a 0-dim tensor on the device."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def scale_and_clip(
        self, factor: float, max_norm: float, grads: List[torch.Tensor]
    ) -> torch.Tensor:
        """Multiply the summed ``grads`` by ``factor`` (``1 / global count``) and clip them to
        ``max_norm`` (0 = no clipping) in ONE pass over them: the norm of the scaled gradients
        is ``factor`` times theirs, and the clip coefficient (``clip_grad_norm_``'s,
        ``min(1, max_norm / (norm + 1e-6))``) is folded into the one multiply. Returns that
        norm (before clipping) as a 0-dim tensor on the device (nothing read on the host)."""
        if not grads:
            return torch.zeros((), device=self.device)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        return _scale_and_clip_with(grads, norm, factor, max_norm)

    def model_state(self) -> Dict[str, Any]:
        """The full model state (rank 0 saves it)."""
        return self.model.state_dict()

    def load_model_state(self, state: Dict[str, Any]) -> None:
        """Load a full model state (raises RuntimeError on another shape)."""
        self.model.load_state_dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer state, parameters numbered in ``param_groups`` order."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        """Load an optimizer state of :meth:`optimizer_state`'s layout."""
        optimizer.load_state_dict(state)

    # --------------------------------------------------------------- checkpoint state I/O
    def save_state(
        self,
        checkpoints: CheckpointManager,
        step: int,
        rdv: Gang,
        optimizer: torch.optim.Optimizer,
        state: StateFn,
    ) -> Path:
        """Checkpoint ``step`` (a collective): rank 0 computes the whole state (``state(True)``:
        the model and optimizer state of :meth:`model_state` and :meth:`optimizer_state`) and
        writes it (:meth:`CheckpointManager.save_on_rank0`)."""
        return checkpoints.save_on_rank0(step, rdv, lambda: state(True))

    def load_state(
        self, optimizer: torch.optim.Optimizer, state: Dict[str, Any], source: str
    ) -> None:
        """Load a checkpoint's model and optimizer state: the full state, a sharded
        checkpoint's made whole first (:func:`~hetseq_hpc.train.checkpoint.shards.
        with_full_tensors`, read by this process alone).

        Raises:
            CheckpointError: the checkpoint holds another model; one line naming ``source``.
        """
        state = with_full_tensors(state, Path(source))
        try:
            self.load_model_state(state["model"])
        except RuntimeError as exc:
            raise CheckpointError(
                f"checkpoint {source!r} holds a different model ({str(exc).splitlines()[0]}): "
                "use the task.model settings it was trained with, or a new run directory"
            ) from None
        self.load_optimizer_state(optimizer, state["optimizer"])

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[nn.Module]:
        """The bare model, whole (it always is)."""
        yield self.model

    def for_evaluation(self, fixed_passes: bool) -> contextlib.AbstractContextManager:
        """The bare model (validation runs no collective under DDP)."""
        return self.unsharded()

    def describe(self) -> Dict[str, Any]:
        """The strategy for ``summary.json``'s ``sharding``."""
        return {"mode": self.mode}


class Sharded(Replicated):
    """FSDP2 over every rank (see the module docstring for the exactness rules).

    Args:
        model: the bare model, on the CPU or on ``device`` (sharded in place: each unit's shards
            land on ``device``, so the whole model is never on the device at once).
        units: the sharding units (:meth:`Task.sharding_units`).
        device: this rank's device.
        cpu_offload: keep the sharded state in CPU memory (``CPUOffloadPolicy``; GPUs only).
        checkpoint: ``sharding.checkpoint``: ``sharded`` (every rank writes its own shards,
            :meth:`save_state`) or ``full`` (gathered, rank 0 writes the whole state).
        precisions: every rank's compute precision, rank order
            (:func:`~hetseq_hpc.train.precision.fsdp_param_dtype`: all bf16 = parameters
            gathered in bf16, the shards and the gradient reduce in fp32; else all fp32).
        grouped: the units sharded as ONE group (``fully_shard`` of their list: one all-gather
            and one reduce-scatter per pass for all of them; the same on every rank:
            :func:`~hetseq_hpc.balance.agree.agree_on_units`), else each on its own.
    """

    sharded = True
    mode = "fsdp"

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[nn.Module],
        device: torch.device,
        cpu_offload: bool = False,
        checkpoint: str = "sharded",
        precisions: Sequence[Optional[str]] = (),
        grouped: bool = False,
    ):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        super().__init__(model, device)
        self.checkpoint = checkpoint
        offload = CPUOffloadPolicy() if cpu_offload and device.type == "cuda" else OffloadPolicy()
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        self.group = mesh.get_group()  # the shards' group (the gradient norm's all-reduce)
        self.units = list(units)
        self.grouped = bool(grouped) and len(self.units) > 1
        # whole, root and largest unit (grouped: all units are one), in bytes
        self.sizes = unit_bytes(model, self.units)
        if self.grouped:
            self.sizes = self.sizes.grouped()
        #: between the passes of a step: ``reshard`` or ``keep_unsharded`` (the same on every
        #: rank: :func:`hetseq_hpc.train.fsdp_accumulation.agree_on_accumulation`)
        self.between_micro_batches = "reshard"
        self._passes = 1  # of the current step (pass_sizes)
        self.param_dtype, self.param_dtype_why = fsdp_param_dtype(precisions)
        if not self.units:
            self.param_dtype, self.param_dtype_why = None, "no sharding units: the root stays fp32"
        # the units (BERT's layers: most of the bytes) gathered in param_dtype; the root's
        # parameters (embeddings, the task's head) in fp32 always: they are used outside
        # autocast's matmuls (embedding sums, their LayerNorm), where bf16 would round
        # values fp32 computes (docs/design/sharding.md)
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        if self.grouped:  # one FSDP group: one all-gather and one reduce-scatter per pass
            fully_shard(self.units, mesh=mesh, offload_policy=offload, mp_policy=policy)
        else:
            for unit in self.units:
                fully_shard(unit, mesh=mesh, offload_policy=offload, mp_policy=policy)
        root = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=root)
        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for module in self.fsdp_modules:  # a plain SUM over ranks, not FSDP's mean
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
        self.offload = cpu_offload and device.type == "cuda"
        log.info(
            "FSDP2: %d units%s + root over all ranks; the units' parameters all-gathered in %s "
            "on every rank (%s; the root's, the shards, the optimizer and the gradient "
            "reduce-scatter in fp32)%s",
            len(self.units),
            " in one group" if self.grouped else "",
            self.gather_dtype(),
            self.param_dtype_why,
            "; sharded state offloaded to CPU" if self.offload else "",
        )

    def gather_dtype(self) -> str:
        """The dtype the units' parameters are all-gathered in: ``bf16`` or ``fp32`` (the
        root's are always gathered in fp32)."""
        return "bf16" if self.param_dtype == torch.bfloat16 else "fp32"

    def start(
        self, grad_path: Optional[GradientPath] = None, hook_state: Optional[HookState] = None
    ) -> None:
        """Nothing to wrap: the model was sharded in place (no comm hook runs under FSDP)."""

    def pass_sizes(
        self, share: RankShare, all_shares: Sequence[RankShare]
    ) -> Tuple[List[int], int]:
        """The job's largest accumulation count of passes on every rank
        (:func:`equal_pass_sizes`): FSDP gathers parameters in every pass, on every rank."""
        self._passes = max(len(s.micro_sizes) for s in all_shares)
        return equal_pass_sizes(share.samples, self._passes)

    @contextlib.contextmanager
    def sync(self, last: bool) -> Iterator[None]:
        """Around a pass's forward: reduce-scatter in every pass (the memory of the shards
        only; see the module doc). Under ``keep_unsharded`` the units stay gathered after this
        forward (its backward gathers nothing) and, unless ``last``, after its backward too
        (the next pass gathers nothing); the last backward reshards them for the optimizer:
        one all-gather per unit per step, a step of one pass included."""
        if self.between_micro_batches != "keep_unsharded":
            yield
            return
        for module in self.fsdp_modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(last, recurse=False)
        try:
            yield
        finally:  # read in the forward only: the default again for validation
            for module in self.fsdp_modules:
                module.set_reshard_after_forward(module is not self.model, recurse=False)

    def grad_norm(self, max_norm: float, grads: List[torch.Tensor]) -> float:
        """The global norm over every rank's shards (a collective), clipped to ``max_norm``
        (0 = measured only: the clip factor is 1 exactly)."""
        return float(self.grad_norm_tensor(max_norm, grads))

    def _global_norm(self, local: List[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of the whole gradient from this rank's shards ``local`` (plain tensors):
        the squares of the shards' norms summed over the ranks by one all-reduce of a 0-dim
        tensor on the device (a collective; nothing is read on the host)."""
        if local:
            squares = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local))) ** 2
        else:
            squares = torch.zeros((), device=self.device)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.group)
        return squares.sqrt()

    def scale_and_clip(
        self, factor: float, max_norm: float, grads: List[torch.Tensor]
    ) -> torch.Tensor:
        """As :meth:`Replicated.scale_and_clip`, on this rank's shards of the gradients (the
        DTensors' local tensors): the whole gradient's norm from the ranks' shards
        (:meth:`_global_norm`, one small all-reduce on the device, no ``full_tensor``), then
        ``1 / N`` and the clip coefficient in ONE multiply. Returns the norm before clipping
        as a 0-dim tensor on the device (nothing read on the host: the step can be read a
        step late, as a replicated one is)."""
        local = _local_tensors(grads)
        return _scale_and_clip_with(local, self._global_norm(local), factor, max_norm)

    def grad_norm_tensor(self, max_norm: float, grads: List[torch.Tensor]) -> torch.Tensor:
        """:meth:`grad_norm` as a 0-dim tensor on the device (the whole gradient's norm from
        the shards, :meth:`_global_norm`); the shards clipped as ``clip_grad_norm_`` does:
        by ``min(1, max_norm / (norm + 1e-6))``."""
        local = _local_tensors(grads)
        norm = self._global_norm(local)
        if max_norm > 0:
            torch._foreach_mul_(local, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    @staticmethod
    def _shard_options() -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=False)

    def model_state(self) -> Dict[str, Any]:
        """The full model state, gathered (a collective: EVERY rank calls it); rank 0 gets
        the tensors, the others an empty dict."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=self._options())

    def load_model_state(self, state: Dict[str, Any]) -> None:
        """Shard a full model state onto this rank (every rank passes the full state)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        missing, unexpected = set_model_state_dict(
            self.model, state, options=StateDictOptions(full_state_dict=True, strict=False)
        )
        if missing or unexpected:
            raise RuntimeError(
                f"missing keys {list(missing)[:3]}, unexpected keys {list(unexpected)[:3]}"
            )

    def _fqns(self, optimizer: torch.optim.Optimizer) -> List[str]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The full optimizer state in :meth:`torch.optim.Optimizer.state_dict`'s layout
        (parameters numbered in ``param_groups`` order, as DDP's is), gathered (EVERY rank
        calls it; rank 0 gets it, the others an empty dict)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        full: Dict[str, Any] = get_optimizer_state_dict(
            self.model, optimizer, options=self._options()
        )
        if not full:
            return {}
        index = {name: i for i, name in enumerate(self._fqns(optimizer))}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
        return {"state": {index[n]: v for n, v in full["state"].items()}, "param_groups": groups}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        """Shard a full optimizer state (DDP's layout) onto this rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        fqns = self._fqns(optimizer)
        # torch creates the empty optimizer state to load into by a step on zero gradients,
        # which it skips while any gradient is set (only at resume, before any backward pass)
        optimizer.zero_grad(set_to_none=True)
        groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in state["param_groups"]]
        named: Dict[str, Any] = {
            "state": {fqns[int(i)]: v for i, v in state["state"].items()},
            "param_groups": groups,
        }
        set_optimizer_state_dict(
            self.model, optimizer, named, options=StateDictOptions(full_state_dict=True)
        )

    # --------------------------------------------------------------- checkpoint state I/O
    def save_state(
        self,
        checkpoints: CheckpointManager,
        step: int,
        rdv: Gang,
        optimizer: torch.optim.Optimizer,
        state: StateFn,
    ) -> Path:
        """Checkpoint ``step`` (a collective): under ``checkpoint=sharded`` every rank writes
        its shards (:meth:`write_shards`, :meth:`CheckpointManager.save_sharded`) and rank 0
        the record (``state(False)``), in the background with ``trainer.checkpoint_async``
        (:meth:`CheckpointManager.save_sharded_in_background`: only the staging of this rank's
        shards to CPU memory blocks); else the whole state is gathered by every rank and rank 0
        writes it."""
        if self.checkpoint == "sharded" and checkpoints.asynchronous and rdv.cpu_group is not None:
            # trainer.checkpoint_async: staged here, written and committed in the background
            tensors, groups = self.shard_state(optimizer)
            entries = {"model": {}, "optimizer": {"param_groups": groups}}
            return checkpoints.save_sharded_in_background(step, rdv, state(False), tensors, entries)
        if self.checkpoint == "sharded":
            return checkpoints.save_sharded(
                step, rdv, state(False), functools.partial(self.write_shards, optimizer)
            )
        full = state(True)  # gathered by every rank now
        return checkpoints.save_on_rank0(step, rdv, lambda: full)

    def shard_state(
        self, optimizer: torch.optim.Optimizer
    ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
        """This rank's shards: ``({"model": {fqn: DTensor}, "optim": {fqn: {name: tensor}}},
        param_groups)`` (parameter names in the groups' ``params``). Only tensors go to DCP (it
        would pickle anything else); the groups go to the record."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = self._shard_options()
        optim: Dict[str, Any] = get_optimizer_state_dict(self.model, optimizer, options=options)
        tensors = {
            "model": get_model_state_dict(self.model, options=options),
            "optim": optim["state"],
        }
        return tensors, optim["param_groups"]

    def write_shards(self, optimizer: torch.optim.Optimizer, directory: Path) -> Dict[str, Any]:
        """Write this rank's shards into ``directory`` with DCP (every rank, in parallel);
        returns the record's ``model`` and ``optimizer`` entries (the optimizer's
        ``param_groups``)."""
        import torch.distributed.checkpoint as dcp

        tensors, groups = self.shard_state(optimizer)
        check_write(directory)  # a left-out rank writes no shard (save_sharded asked too)
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(directory, sync_files=True, thread_count=1),
        )
        return {"model": {}, "optimizer": {"param_groups": groups}}

    def load_state(
        self, optimizer: torch.optim.Optimizer, state: Dict[str, Any], source: str
    ) -> None:
        """Load a checkpoint's model and optimizer state (a collective): a sharded checkpoint
        into this rank's shards (:meth:`load_shards`: each rank reads what its shard needs),
        a full one sharded onto the ranks.

        Raises:
            CheckpointError: the checkpoint holds another model; one line naming ``source``.
        """
        if "shards" in state:
            self.load_shards(
                optimizer,
                shard_dir_of(Path(source), state),
                state["optimizer"]["param_groups"],
                source,
            )
            return
        super().load_state(optimizer, state, source)

    def load_shards(
        self,
        optimizer: torch.optim.Optimizer,
        directory: Path,
        param_groups: List[Dict[str, Any]],
        source: str,
    ) -> None:
        """Load a sharded checkpoint into this rank's FSDP2 shards (a collective: EVERY rank
        calls it); DCP reads the pieces each shard needs, whatever world size wrote them.

        Raises:
            CheckpointError: the checkpoint holds another model (names, shapes), or reading
                failed.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = self._shard_options()
        metadata = read_metadata_safely(directory)
        model_sd = get_model_state_dict(self.model, options=options)
        _same_model(set(model_sd), _model_keys(metadata), source)
        # torch creates the optimizer state to load into by a step on zero gradients (lr 0)
        optimizer.zero_grad(set_to_none=True)
        full_optim: Dict[str, Any] = get_optimizer_state_dict(
            self.model, optimizer, options=options
        )
        optim = full_optim["state"]
        saved = {key for key in metadata.state_dict_metadata if key.startswith("optim.")}
        optim = {
            fqn: v
            for fqn, v in optim.items()  # parameters that never had a gradient
            if all(f"optim.{fqn}.{k}" in saved for k in v)
        }
        tensors = {"model": model_sd, "optim": optim}
        try:
            dcp.load(
                tensors,
                storage_reader=safe_reader(directory),
                planner=DefaultLoadPlanner(allow_partial_load=True),
            )
        except Exception as exc:
            raise load_error(source, exc) from None
        set_model_state_dict(self.model, tensors["model"], options=options)
        set_optimizer_state_dict(
            self.model,
            optimizer,
            {"state": tensors["optim"], "param_groups": param_groups},
            options=options,
        )

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[nn.Module]:
        """Every unit gathered whole for the duration (one all-gather per unit on EVERY rank,
        then no collective inside: validation, decoding and examples may run any number of
        forward passes on one rank), resharded after."""
        for module in self.fsdp_modules:
            module.set_reshard_after_forward(False, recurse=False)
        for module in self.fsdp_modules:
            module.unshard()
        try:
            yield self.model
        finally:
            for module in self.fsdp_modules:
                module.reshard()
                module.set_reshard_after_forward(module is not self.model, recurse=False)

    @contextlib.contextmanager
    def local_passes(self) -> Iterator[nn.Module]:
        """:meth:`unsharded`, with gradients kept whole on this rank (no reduce-scatter, no
        resharding after backward): forward/backward passes run no collective, so each rank
        times its OWN speed and may run any number of passes (calibration). Holds the whole
        weights and gradients (2 x the parameter bytes) for the duration; zero the gradients
        before leaving."""
        for module in self.fsdp_modules:
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
        try:
            with self.unsharded() as whole:
                yield whole
        finally:
            for module in self.fsdp_modules:
                module.set_requires_gradient_sync(True, recurse=False)
                module.set_reshard_after_backward(True, recurse=False)

    @contextlib.contextmanager
    def for_evaluation(self, fixed_passes: bool) -> Iterator[nn.Module]:
        """The model validation runs on: the sharded model itself when the task's
        ``evaluate_batch`` runs a fixed number of forward passes (every rank then runs as many
        batches, each forward gathering one unit at a time: the whole weights are never on a
        rank), else :meth:`unsharded`. Everything is resharded after (the root keeps its
        parameters gathered after a forward without backward)."""
        if not fixed_passes:
            with self.unsharded() as whole:
                yield whole
            return
        try:
            yield self.model
        finally:
            for module in self.fsdp_modules:
                module.reshard()

    def describe(self) -> Dict[str, Any]:
        """The strategy for ``summary.json``'s ``sharding``."""
        return {
            "mode": self.mode,
            "units": len(self.units),
            "units_grouped": self.grouped,
            "all_gather_dtype": self.gather_dtype(),
            "root_all_gather_dtype": "fp32",
            "reduce_dtype": "fp32",
            "all_gather_dtype_why": self.param_dtype_why,
            "cpu_offload": self.offload,
            "between_micro_batches": self.between_micro_batches,
        }


def _scale_and_clip_with(
    grads: List[torch.Tensor], norm: torch.Tensor, factor: float, max_norm: float
) -> torch.Tensor:
    """Multiply ``grads`` (whose whole norm is ``norm``, a 0-dim tensor) by ``factor`` and
    ``clip_grad_norm_``'s coefficient ``min(1, max_norm / (factor x norm + 1e-6))`` in ONE
    pass (``max_norm`` 0: by ``factor`` only); returns ``factor x norm``, the scaled norm
    before clipping, on the device."""
    scaled = norm * factor
    if max_norm > 0:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (scaled + 1e-6), max=1.0) * factor)
    else:
        torch._foreach_mul_(grads, factor)
    return scaled


def _local_tensors(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """This rank's part of each gradient: a DTensor's local shard, a plain tensor itself."""
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def _model_keys(metadata: Any) -> set:
    return {
        key[len("model.") :] for key in metadata.state_dict_metadata if key.startswith("model.")
    }


def _same_model(wanted: set, saved: set, source: str) -> None:
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {source!r} holds a different model (missing keys {missing[:3]}, "
            f"unexpected keys {unexpected[:3]}): use the task.model settings it was trained with, "
            "or a new run directory"
        )


def rank_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    watch: Optional[MemoryWatch] = None,
) -> Dict[str, float]:
    """What this rank holds and has used, in bytes: ``state_bytes`` (its parameters, as many
    gradient bytes, and its optimizer state: local shards under FSDP), ``peak_rss_bytes`` (the
    process's peak resident memory, since the watch's window began where it could reset it:
    Python and torch's libraries included, ~0.4 GB on CPU),
    on a GPU ``cuda_peak_bytes`` (``torch.cuda.max_memory_allocated``) and, with ``watch``
    (:class:`~hetseq_hpc.balance.peak.MemoryWatch`), the measured peak of what the budget
    bounds next to it: ``measured_peak_bytes``, ``budget_bytes``, ``peak_measure`` (logged)."""
    params = sum(local_part(p).numel() * local_part(p).element_size() for p in model.parameters())
    moments = sum(
        local_part(v).numel() * local_part(v).element_size()
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    out: Dict[str, Any] = {"state_bytes": float(2 * params + moments)}
    if watch is not None:
        out.update(watch.report(dist.get_rank() if dist.is_initialized() else 0))
    out["peak_rss_bytes"] = peak_resident_bytes()
    if device.type == "cuda":
        out["cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
    return out


def build_parallel(
    run: RunConfig,
    task: Task,
    model: nn.Module,
    device: torch.device,
    mode: str,
    precisions: Sequence[Optional[str]] = (),
    grouped: bool = False,
) -> Replicated:
    """The strategy for ``mode`` (``ddp`` or ``fsdp``, as decided for ``sharding.mode``), with
    ``sharding.activation_checkpointing`` applied to the task's sharding units first, then
    ``trainer.compile`` (each unit compiled in place, :mod:`hetseq_hpc.train.compile`). ``ddp``
    moves the model to ``device``; ``fsdp`` shards it onto ``device`` (a collective: every
    rank calls this at the same point), gathering parameters in bf16 when every rank of
    ``precisions`` (rank order; none given = fp32) computes in bf16; ``grouped``: the units as
    one FSDP group (:class:`Sharded`)."""
    units = list(task.sharding_units(model)) if hasattr(task, "sharding_units") else []
    if run.sharding.activation_checkpointing:
        if not units:
            log.warning(
                "sharding.activation_checkpointing=true, but the task names no sharding "
                "units: nothing is recomputed"
            )
        activation_checkpointing(units)
    if compiles(run.trainer.compile, device):
        done = compile_in_place(model, units)
        log.info(
            "trainer.compile=%s: %d module(s) compiled in place (%s); the first steps include "
            "the compile",
            run.trainer.compile,
            len(done),
            type(done[0]).__name__,
        )
    if mode == "fsdp":
        return Sharded(
            model,
            units,
            device,
            run.sharding.cpu_offload,
            run.sharding.checkpoint,
            precisions,
            grouped,
        )
    return Replicated(model.to(device), device)


__all__ = [
    "Replicated",
    "Sharded",
    "activation_checkpointing",
    "build_parallel",
    "equal_pass_sizes",
    "rank_memory",
]
