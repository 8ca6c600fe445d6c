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
    python scripts/bench_checkpoint.py --sharded [--ranks 2] [--saves 3] [--dir DIR]

``--sharded``: the same model sharded with FSDP2 over ``--ranks`` real processes (gloo), each
saving its shards (:meth:`CheckpointManager.save_sharded`, or in the background:
:meth:`CheckpointManager.save_sharded_in_background`); the time is the slowest rank's per save.

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


def _sharded_rank(rank: int, ranks: int, port: int, saves: int, directory: str, queue: Any) -> None:
    """One rank of the sharded measurement: BERT-base sharded with FSDP2 (one unit per encoder
    layer), AdamW's moments made, then ``saves`` saves per mode; puts ``(rank, result)``."""
    from transformers import BertConfig, BertForMaskedLM

    from hetseq_hpc.distributed.rendezvous import rendezvous
    from hetseq_hpc.env.world import WorldInfo
    from hetseq_hpc.rundir.paths import RunDir
    from hetseq_hpc.train.parallel import Sharded

    torch.set_num_threads(1)
    world = WorldInfo(
        rank=rank, local_rank=rank, world_size=ranks, master_addr="127.0.0.1", master_port=port
    )
    with rendezvous(world, torch.device("cpu"), 600) as rdv:
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig())
        strategy = Sharded(model, list(model.bert.encoder.layer), torch.device("cpu"))
        optimizer = torch.optim.AdamW(strategy.model.parameters(), lr=1e-4)
        for p in strategy.model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        result: Dict[str, Any] = {}
        for name, asynchronous in (("sync", False), ("async", True)):
            run_dir = RunDir(Path(directory) / name)
            manager = CheckpointManager(run_dir, keep=1, asynchronous=asynchronous)
            blocked, written = [], []
            for step in range(1, saves + 1):
                rdv.barrier()
                start = time.perf_counter()
                manager.save(
                    step,
                    rdv,
                    strategy,
                    optimizer,
                    lambda tensors, step=step: {"scheduler": {}, "step": step, "run_id": ""},
                )
                blocked.append(time.perf_counter() - start)
                pending = manager.pending
                manager.finish(rdv)  # training would run here (not counted)
                if pending is not None:
                    written.append(pending.seconds)
            folder = run_dir.checkpoints
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            result[name] = {"blocked_s": blocked, "background_write_s": written, "bytes": size}
        queue.put((rank, result))


def sharded_main(args: argparse.Namespace) -> None:
    """``--sharded``: every rank's blocking time per save in both modes; print the slowest
    rank's and the JSON line (``checkpoint_block_s``, ``checkpoint_block_sync_s``)."""
    import torch.multiprocessing as mp

    from hetseq_hpc.env.world import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        procs = [
            ctx.Process(
                target=_sharded_rank, args=(r, args.ranks, port, max(1, args.saves), tmp, queue)
            )
            for r in range(args.ranks)
        ]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join()
    out: Dict[str, Any] = {"mode": f"sharded, {args.ranks} ranks (FSDP2, gloo)"}
    for name in ("sync", "async"):
        per_save = [
            max(results[r][name]["blocked_s"][i] for r in results)
            for i in range(max(1, args.saves))
        ]
        written = [max(s) for s in zip(*(results[r][name]["background_write_s"] for r in results))]
        print(
            f"{name}: blocked {', '.join(f'{s:.2f}' for s in per_save)} s per save (slowest rank)"
            + (
                f"; written in the background in {', '.join(f'{s:.2f}' for s in written)} s"
                if written
                else ""
            )
            + f" ({results[0][name]['bytes'] / 1e9:.2f} GB on disk)",
            flush=True,
        )
        key = "checkpoint_block_s" if name == "async" else "checkpoint_block_sync_s"
        out[key] = round(statistics.median(per_save), 3)
        out["checkpoint_bytes"] = results[0][name]["bytes"]
        if written:
            out["checkpoint_write_s"] = round(statistics.median(written), 3)
    out["torch"] = torch.__version__
    out["machine"] = platform.machine()
    print(json.dumps(out))


def main() -> None:
    """Time both modes on one state; print each and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=3, help="saves per mode (default 3)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default /tmp)")
    parser.add_argument(
        "--sharded", action="store_true", help="FSDP2 over --ranks processes, sharded saves"
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks of --sharded (default 2)")
    args = parser.parse_args()
    if args.sharded:
        sharded_main(args)
        return
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
