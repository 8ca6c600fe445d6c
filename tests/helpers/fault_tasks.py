"""Test tasks that cause a fault on one rank of a real run (``task=custom``): the tests inject
their faults here, hetseq_hpc has no switch for them.

All train the small BERT of :data:`~tests.helpers.runs.SMALL_MODEL` (its sizes given as
``+task.model.<name>``, the task's options as ``+task.args.<name>``); each class's docstring
says which fault it causes and which ``+task.args`` set it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, List

from hetseq_hpc.config.tasks import BertDataConfig, BertModelConfig, BertTaskConfig
from hetseq_hpc.distributed.rendezvous import Rendezvous
from hetseq_hpc.tasks.bert.mlm_task import BertTask
from hetseq_hpc.train import precision
from tests.helpers.runs import REPO, SMALL_MODEL


def fault_task(cls: str, **args) -> List[str]:
    """Overrides that train the small BERT as this module's task ``cls`` with ``args``."""
    return [
        "task=custom",
        f"task.target={__name__}.{cls}",
        f"task.path={REPO}",
        *(f"+{override}" for override in SMALL_MODEL),
        *(f"+task.args.{name}={value}" for name, value in args.items()),
    ]


def fail_on_rank(rank: int) -> List[str]:
    """Overrides of a run whose rank ``rank`` raises right after the rendezvous."""
    return fault_task("FailingBert", fail_rank=rank)


def overflow_at(rank: int, step: int) -> List[str]:
    """Overrides of a run whose rank ``rank`` overflows in the backward pass of ``step``."""
    return fault_task("OverflowBert", overflow_rank=rank, overflow_step=step)


def this_rank() -> int:
    """This process's rank, from the environment (local launcher: RANK; Slurm: SLURM_PROCID)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


class _Bert(BertTask):
    """BERT with ``task.model`` as its model config and the default data (``task=custom``)."""

    def __init__(self, cfg, seed: int):
        model = {f.name: cfg.model[f.name] for f in fields(BertModelConfig) if f.name in cfg.model}
        super().__init__(
            BertTaskConfig(model=BertModelConfig(**model), data=BertDataConfig()), seed
        )
        self.args = dict(cfg.args)


class FailingBert(_Bert):
    """Raises ``RuntimeError("injected failure on rank N")`` in ``load()`` on the rank
    ``+task.args.fail_rank=N`` names (right after the rendezvous and rank 0's prepare), for
    testing launchers and error reports."""

    def load(self) -> None:
        if this_rank() == int(self.args["fail_rank"]):
            raise RuntimeError(f"injected failure on rank {this_rank()}")
        super().load()


def overflowing_backward(backward: Callable, rank: int, step: int) -> Callable:
    """``GradientPath.backward`` that multiplies the loss by inf on ``rank`` at ``step``."""

    def wrapped(self, loss, at_step, *args, **kwargs):
        if self.rank == rank and at_step == step:
            loss = loss * float("inf")
        return backward(self, loss, at_step, *args, **kwargs)

    return wrapped


class OverflowBert(_Bert):
    """Puts inf into the scaled loss that backward sees (the logged loss stays finite) on rank
    ``+task.args.overflow_rank`` at optimizer step ``+task.args.overflow_step``: an fp16
    overflow on one rank, for testing the loss scale."""

    def load(self) -> None:
        super().load()
        path = precision.GradientPath
        path.backward = overflowing_backward(
            path.backward, int(self.args["overflow_rank"]), int(self.args["overflow_step"])
        )


def at_barrier_marker(marker: Path, rank: int) -> Path:
    """The file rank ``rank`` of a :class:`SlowExamplesBert` run writes as it enters the final
    barrier (next to ``+task.args.marker``)."""
    return Path(f"{marker}.barrier{rank}")


class SlowExamplesBert(_Bert):
    """Makes rank 0 take ``+task.args.examples_s`` seconds over its example predictions after
    the last step (the other ranks wait at the final barrier), first writing the file
    ``+task.args.marker``: a window in which a test loses a rank after the training has
    completed. With a marker, every rank also writes :func:`at_barrier_marker` as it enters
    the final barrier (the one ``Rendezvous.barrier`` after :meth:`load`: the start-up one,
    after rank 0's prepare, comes before it), so that the test sees the others waiting there."""

    def load(self) -> None:
        super().load()
        marker = self.args.get("marker")
        if marker:
            barrier = Rendezvous.barrier

            def marked(rdv, *args, **kwargs):
                at_barrier_marker(marker, this_rank()).write_text("barrier")
                return barrier(rdv, *args, **kwargs)

            Rendezvous.barrier = marked

    def examples(self, model, n: int = 3):
        marker = self.args.get("marker")
        if marker:  # the test waits for it: the training, its checkpoint and rows are done
            Path(marker).write_text("examples")
        time.sleep(float(self.args["examples_s"]))
        return []


class StoppedInValidationBert(_Bert):
    """Makes rank ``+task.args.stop_rank`` stop itself (SIGSTOP) in its first validation batch:
    a rank hung in a validation nothing has measured yet. With ``+task.args.sleep_s`` it sleeps
    that long instead: a slow rank, not a hung one; with ``+task.args.when_file=PATH`` it waits
    for its first validation batch after that file exists (the test creates it): a rank hung in
    a later, measured validation, wherever the run's clock is when the test decides."""

    def evaluate_batch(self, model, batch, positions):
        if (
            this_rank() == int(self.args["stop_rank"])
            and not getattr(self, "_stopped", False)
            and os.path.exists(self.args.get("when_file", os.devnull))
        ):
            self._stopped = True
            if "sleep_s" in self.args:
                time.sleep(float(self.args["sleep_s"]))
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        return super().evaluate_batch(model, batch, positions)


class KilledInValidationBert(_Bert):
    """Makes rank ``+task.args.die_rank`` kill itself (SIGKILL) at its first batch of
    validation number ``+task.args.validation`` (1-based: with ``trainer.val_every=1``, the
    validation of that step): a rank lost inside a validation, wherever the run's clock is
    (a kill sent from the test at a guessed time may land in a training step instead)."""

    validations_done = 0

    def evaluate_batch(self, model, batch, positions):
        if (
            this_rank() == int(self.args["die_rank"])
            and self.validations_done == int(self.args["validation"]) - 1
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().evaluate_batch(model, batch, positions)

    def finalize_metrics(self, sums):
        self.validations_done += 1  # once per validation, after the ranks' sums are gathered
        return super().finalize_metrics(sums)


class NanLossBert(_Bert):
    """Makes the model's loss NaN on rank ``+task.args.nan_rank`` in micro-batch
    ``+task.args.nan_micro`` (1-based) of optimizer step ``+task.args.nan_step``: a model or
    data bug on one input."""

    def build_model(self):
        model = super().build_model()
        rank, step = int(self.args["nan_rank"]), int(self.args["nan_step"])
        micro = int(self.args.get("nan_micro", 1))
        at = {"step": None, "n": 0}
        from hetseq_hpc.train.trainer import Trainer

        train_step = Trainer.train_step

        def counted(trainer, k):  # which step the forwards below belong to
            at.update(step=k, n=0)
            return train_step(trainer, k)

        Trainer.train_step = counted

        def hook(module, args, kwargs, output):
            if at["step"] != step or this_rank() != rank:
                return output
            at["n"] += 1
            return output * float("nan") if at["n"] == micro else output

        model.register_forward_hook(hook, with_kwargs=True)
        return model


class DyingBert(_Bert):
    """Makes rank ``+task.args.die_rank`` kill itself (SIGKILL) in start-up:
    ``+task.args.at=build`` when its task is built (before the rendezvous: the others wait in
    it), ``at=prepare`` in ``prepare()`` (rank 0 prepares the data while the others wait on its
    heartbeat file)."""

    def __init__(self, cfg, seed: int):
        super().__init__(cfg, seed)
        self._die_if("build")

    def _die_if(self, at: str) -> None:
        if self.args.get("at") == at and this_rank() == int(self.args["die_rank"]):
            os.kill(os.getpid(), signal.SIGKILL)

    def prepare(self) -> None:
        self._die_if("prepare")
        super().prepare()


class DiesAfterReformBert(_Bert):
    """Makes rank ``+task.args.die_rank`` kill itself (SIGKILL) right after the survivors of a
    lost rank agreed on a new world with it: a rank lost after it joined the re-forming, before
    the new world formed. ``+task.args.after=join_generation``: after the new world's default
    group formed, before its gloo group (CI saw the others wait 300 s there)."""

    def load(self) -> None:
        super().load()
        from hetseq_hpc.train.recovery import elastic

        name, rank = str(self.args.get("after", "reform")), int(self.args["die_rank"])
        step = getattr(elastic, name)

        def done_then_dead(*args, **kwargs):
            out = step(*args, **kwargs)
            if this_rank() == rank:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(elastic, name, done_then_dead)


class StoppedBeforeStatsBert(_Bert):
    """Makes rank ``+task.args.stop_rank`` skip posting its statistics of optimizer step
    ``+task.args.stop_step`` and stop itself (SIGSTOP) where it would wait for them: its
    gradients went through the all-reduce (the others' backward completes), the exchange the
    others then wait for never comes (the chaos soak found the others waiting
    ``cluster.collective_timeout_s`` there, not the step's timeout)."""

    def load(self) -> None:
        super().load()
        post = Rendezvous.post_step_stats
        rank, step = int(self.args["stop_rank"]), int(self.args["stop_step"])
        posted = {"n": 0}

        class _Stopped:
            def result(self):
                os.kill(os.getpid(), signal.SIGSTOP)
                raise RuntimeError("stopped before its step statistics")

        def stopped_first(rdv, stats, *args, **kwargs):
            posted["n"] += 1
            if this_rank() == rank and posted["n"] == step:
                return _Stopped()
            return post(rdv, stats, *args, **kwargs)

        Rendezvous.post_step_stats = stopped_first


class HeldForJoinBert(_Bert):
    """Holds every rank at the start of optimizer step ``+task.args.hold_step`` until a
    replacement rank asked to join the job (its request in the job's store, at most
    ``+task.args.hold_s`` seconds, default 240): a loaded machine may start the replacement
    slower than the run's remaining steps take, and the test checks the join, not a race."""

    def load(self) -> None:
        super().load()
        from hetseq_hpc.distributed.admission import join_requests
        from hetseq_hpc.train.trainer import Trainer

        train_step = Trainer.train_step
        hold, limit = int(self.args["hold_step"]), float(self.args.get("hold_s", 240))

        def held(trainer, k, *args, **kwargs):
            if k == hold and trainer.elastic is not None and self.holds():
                deadline = time.monotonic() + limit
                while join_requests(trainer.elastic.store) < 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
            return train_step(trainer, k, *args, **kwargs)

        Trainer.train_step = held

    def holds(self) -> bool:
        """Whether to hold now that step ``hold_step`` starts (always, here)."""
        return True


class DiesAfterAdmittingBert(HeldForJoinBert):
    """:class:`HeldForJoinBert` whose rank ``+task.args.die_rank`` kills itself (SIGKILL) right
    after the survivors answered a newcomer's join request, before the grown world formed:
    the newcomer's join fails with the survivors' re-forming."""

    def load(self) -> None:
        super().load()
        from hetseq_hpc.train.recovery import grow

        answer, rank = grow.answer, int(self.args["die_rank"])

        def answered_then_dead(*args, **kwargs):
            answer(*args, **kwargs)
            if this_rank() == rank:
                os.kill(os.getpid(), signal.SIGKILL)

        grow.answer = answered_then_dead


class KilledAtStepBert(_Bert):
    """Makes rank ``+task.args.die_rank`` kill itself (SIGKILL) as optimizer step
    ``+task.args.die_step`` starts, once: it first creates ``+task.args.marker`` (a requeued
    job that resumes before that step does not die again). A kill sent from a test after it
    saw step 10 landed after the run's last step once (30 steps in a second on the test
    cluster)."""

    def load(self) -> None:
        super().load()
        from hetseq_hpc.train.trainer import Trainer

        train_step = Trainer.train_step
        rank, step = int(self.args["die_rank"]), int(self.args["die_step"])
        marker = Path(str(self.args["marker"]))

        def killed(trainer, k, *args, **kwargs):
            if k == step and this_rank() == rank and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return train_step(trainer, k, *args, **kwargs)

        Trainer.train_step = killed


class KilledThenHeldBert(KilledAtStepBert, HeldForJoinBert):
    """:class:`KilledAtStepBert` and :class:`HeldForJoinBert` together: rank
    ``+task.args.die_rank`` kills itself as step ``+task.args.die_step`` starts, and every rank
    holds at step ``+task.args.hold_step`` until its replacement asked to join (a Slurm step
    starts in seconds, the remaining steps may take less). The hold starts only after the kill
    (its marker exists): a ``hold_step`` before ``die_step`` is held when the survivors redo it
    after an FSDP reload, so the replacement joins right after that redone step."""

    def holds(self) -> bool:
        return Path(str(self.args["marker"])).exists()
