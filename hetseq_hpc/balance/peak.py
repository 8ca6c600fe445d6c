"""A rank's measured peak of what its memory budget bounds, to print next to the budget.

:class:`MemoryWatch` measures it from when the model is placed: ``torch.cuda.max_memory_allocated``
on a GPU; torch's profiler memory events on a CPU with an emulated budget (:func:`running_peak`);
else the resident set's growth (an upper bound). ``peak_measure`` says which.
What each measure counts and misses: docs/design/allocation.md, "A rank's measured memory peak".
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover (torch is imported where it is used)
    import torch
    from torch import nn

log = logging.getLogger(__name__)

_MIB = 2.0**20
#: optimizer steps (calibration's timed one included) the CPU allocations are recorded for
PROFILED_STEPS = 6


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``; nothing elsewhere),
    so the resident set counts memory in use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(key: str) -> Optional[float]:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``), None where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def resident_bytes() -> float:
    """This process's resident memory now (``VmRSS``; else its peak, ``ru_maxrss``)."""
    kib = _status_kib("VmRSS")
    if kib is None:
        kib = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return kib * 1024.0


def peak_resident_bytes() -> float:
    """This process's peak resident memory since it started or since :func:`reset_peak_resident`
    (``VmHWM``; else ``ru_maxrss``)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return kib * 1024.0


def reset_peak_resident() -> bool:
    """Reset this process's peak resident memory to the current resident set (Linux >= 4.0:
    ``5`` into ``/proc/self/clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the duration (the profiler's start/stop lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w", encoding="ascii") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class CpuAllocations:
    """torch's own record of its CPU tensor allocations (the profiler's memory events), from
    construction to :meth:`stop`, or to the end of the ``steps``-th optimizer step (a global
    step hook: this process's only optimizer)."""

    def __init__(self, steps: int = PROFILED_STEPS):
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.profiler import ProfilerActivity, profile

        self.peak: Optional[float] = None
        self.steps_left = int(steps)
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self.profiler.start()
        self.hook = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, *_: Any) -> None:
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.stop()

    def stop(self) -> float:
        """Stop recording (once); the peak of the bytes allocated and not yet freed
        (:func:`running_peak`), bytes."""
        if self.peak is None:
            self.hook.remove()
            with _quiet_stderr():
                self.profiler.stop()
            peak = float(running_peak(allocation_events(self.profiler)))
            self.peak = peak
            del self.profiler  # its record may be large
            return peak
        return self.peak


def allocation_events(profiler: Any) -> List[Tuple[int, int, int]]:
    """The CPU tensor allocations and frees a stopped profiler recorded, in time order:
    ``(time_ns, address, bytes)``, bytes negative for a free."""
    events: List[Tuple[int, int, int]] = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        extra = node.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation" and extra.device.type == "cpu":
            events.append((node.start_time_ns, int(extra.ptr), int(extra.alloc_size)))
        stack.extend(node.children)
    events.sort(key=lambda e: e[0])
    return events


def running_peak(events: List[Tuple[int, int, int]]) -> int:
    """The peak of the bytes allocated and not yet freed, from ``(time_ns, address, bytes)``
    events in time order (:func:`allocation_events`).

    The profiler records a free only on a thread it profiles, so a tensor whose last reference
    goes on another thread (a peer's ``Work`` finished by gloo, a Python thread) is never seen
    freed, and a plain running sum drifts upwards over the window (measured here: 13 to 25 MiB
    for identical runs whose allocations peak at 12). An allocation at an address still held
    proves the earlier block freed by then: it is taken off at that moment (an upper bound of
    its lifetime). A free of an address allocated before the window counts as in the plain sum
    (the window's baseline holds it)."""
    live: Dict[int, int] = {}
    running = peak = 0
    for _, address, nbytes in events:
        if nbytes > 0:
            running += nbytes - live.pop(address, 0)
            live[address] = nbytes
        else:
            running += nbytes
            live.pop(address, None)
        peak = max(peak, running)
    return peak


def tensor_bytes(model: nn.Module) -> float:
    """Bytes of a model's tensors on this rank: parameters (local shards under FSDP), their
    gradients and its buffers."""

    def nbytes(t: torch.Tensor) -> float:
        local = getattr(t, "to_local", None)
        t = local() if callable(local) else t
        return float(t.numel() * t.element_size())

    params = list(model.parameters())
    return (
        sum(nbytes(p) for p in params)
        + sum(nbytes(p.grad) for p in params if p.grad is not None)
        + sum(nbytes(b) for b in model.buffers())
    )


class MemoryWatch:
    """The measured peak of one rank (see the module docstring for what is measured).

    Args:
        device: the rank's device.
        budget_bytes: its memory budget, before the headroom
            (:func:`~hetseq_hpc.balance.memory.memory_budget_bytes`).
        emulated: the budget is configured (``memory_budget_gb``): on the CPU, record torch's
            allocations; else the resident set's growth.
    """

    def __init__(self, device: torch.device, budget_bytes: float, emulated: bool = False):
        self.device = device
        self.budget_bytes = float(budget_bytes)
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.emulated = bool(emulated) and not self.cuda
        self.baseline = 0.0
        self.allocations: Optional[CpuAllocations] = None
        self.method = "cuda_max_memory_allocated" if self.cuda else "rss_growth"

    def begin(self) -> MemoryWatch:
        """Just before the model is built: the resident set the model's growth starts from."""
        if not self.cuda:
            trim_heap()
            self.baseline = resident_bytes()
        return self

    def start_window(self, model: Optional[nn.Module] = None) -> None:
        """Once ``model`` is placed: measure the peak from here (the task-contract check and
        the CPU build of a model about to be sharded are left out)."""
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if self.emulated and model is not None:
            try:
                self.allocations = CpuAllocations()
                self.baseline = tensor_bytes(model)
                self.method = f"torch_cpu_allocations_first_{PROFILED_STEPS}_steps"
                return
            except Exception as exc:  # no profiler: the resident set's growth instead
                log.warning(
                    "memory watch: torch's profiler did not start (%s): measuring the "
                    "resident set's growth instead",
                    exc,
                )
                self.allocations = None
        trim_heap()
        if not reset_peak_resident():
            self.method = "rss_growth_since_start"

    def peak_bytes(self) -> float:
        """The measured peak (bytes)."""
        if self.cuda:
            import torch

            return float(torch.cuda.max_memory_allocated(self.device))
        if self.allocations is not None:
            return self.baseline + self.allocations.stop()
        return max(peak_resident_bytes() - self.baseline, 0.0)

    def report(self, rank: int) -> Dict[str, Any]:
        """``budget_bytes``, ``measured_peak_bytes`` and ``peak_measure`` (how it was measured),
        logged on one line (the rank's log)."""
        peak = self.peak_bytes()
        log.info(
            "rank %d memory: measured peak %.2f MiB (%s) of its budget %.2f MiB (%.0f%%)",
            rank,
            peak / _MIB,
            self.method,
            self.budget_bytes / _MIB,
            100.0 * peak / max(self.budget_bytes, 1.0),
        )
        return {
            "budget_bytes": self.budget_bytes,
            "measured_peak_bytes": peak,
            "peak_measure": self.method,
        }


__all__ = [
    "PROFILED_STEPS",
    "CpuAllocations",
    "MemoryWatch",
    "allocation_events",
    "peak_resident_bytes",
    "reset_peak_resident",
    "resident_bytes",
    "running_peak",
    "tensor_bytes",
    "trim_heap",
]
