#!/usr/bin/env python3
"""How long a checkpoint blocks the training thread: written there (``trainer.checkpoint_async
=false``) against staged to CPU memory and written in the background (``true``, the default).

The state is BERT-base-sized: transformers' ``BertForMaskedLM`` at its default configuration
(≈110M parameters, built from the config, nothing downloaded) with AdamW's two moments, as
rank 0 saves it (:meth:`CheckpointManager.save_on_rank0`, world size 1). Each save is timed on
the calling thread; between two saves the background write is waited for without being
counted (the training between checkpoints, when it is longer than the write). Last line: one
JSON object with ``checkpoint_block_s`` (background) and ``checkpoint_block_sync_s``.

    python scripts/bench_checkpoint.py [--saves 3] [--dir DIR]

Other scripts import :func:`measure_checkpoint_block_s` (scripts/bench_step.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch

from hetseq_hpc.train.checkpoint.manager import CheckpointManager


class _Solo:
    """The rendezvous of a one-rank world: rank 0 saves, nobody else waits."""

    world = SimpleNamespace(rank=0, world_size=1)

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_objects(self, obj: Any) -> list:
        return [obj]


def bert_base_state() -> Dict[str, Any]:
    """A checkpoint state of BERT-base with AdamW (one step taken on zero gradients, so both
    moments exist): ``{"model", "optimizer", "scheduler", "step"}``; ≈1.3 GB of tensors."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {},
        "step": 1,
    }


def _blocks(
    state: Dict[str, Any], asynchronous: bool, saves: int, directory: Path
) -> Dict[str, Any]:
    manager = CheckpointManager(directory, keep=1, asynchronous=asynchronous)
    blocked, written = [], []
    for step in range(1, saves + 1):
        start = time.perf_counter()
        manager.save_on_rank0(step, _Solo(), lambda: state)
        blocked.append(time.perf_counter() - start)
        pending = manager.pending
        error = manager.drain()  # training would run here (not counted)
        if error:
            raise RuntimeError(error)
        if pending is not None:
            written.append(pending.seconds)
    size = manager.path(saves).stat().st_size
    return {"blocked_s": blocked, "background_write_s": written, "bytes": size}


def measure_checkpoint_block_s(
    asynchronous: bool = True,
    saves: int = 3,
    directory: Optional[Path] = None,
    state: Optional[Dict[str, Any]] = None,
) -> float:
    """The training thread's blocking time per checkpoint of a BERT-base-sized state (s): the
    median over ``saves`` saves (>= 1) of the time :meth:`CheckpointManager.save_on_rank0`
    takes, with ``asynchronous`` as ``trainer.checkpoint_async``.

    Args:
        directory: where to write (a temporary folder, removed after, when None).
        state: the state to save (:func:`bert_base_state` when None; build it once to time
            both modes).
    """
    state = state if state is not None else bert_base_state()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        return statistics.median(_blocks(state, asynchronous, saves, Path(tmp))["blocked_s"])


def main() -> None:
    """Time both modes on one state; print each and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=3, help="saves per mode (default 3)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default /tmp)")
    args = parser.parse_args()
    state = bert_base_state()
    tensors = {t.data_ptr(): t for t in state["model"].values()}  # tied weights once
    out: Dict[str, Any] = {"model_numel": sum(t.numel() for t in tensors.values())}
    for name, asynchronous in (("sync", False), ("async", True)):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            got = _blocks(state, asynchronous, max(1, args.saves), Path(tmp))
        print(
            f"{name}: blocked {', '.join(f'{s:.2f}' for s in got['blocked_s'])} s per save"
            + (
                f"; written in the background in {', '.join(f'{s:.2f}' for s in w)} s"
                if (w := got["background_write_s"])
                else ""
            )
            + f" ({got['bytes'] / 1e9:.2f} GB)",
            flush=True,
        )
        key = "checkpoint_block_s" if asynchronous else "checkpoint_block_sync_s"
        out[key] = round(statistics.median(got["blocked_s"]), 3)
        out["checkpoint_bytes"] = got["bytes"]
        if asynchronous:
            out["checkpoint_write_s"] = round(statistics.median(got["background_write_s"]), 3)
    out["torch"] = torch.__version__
    out["machine"] = platform.machine()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
