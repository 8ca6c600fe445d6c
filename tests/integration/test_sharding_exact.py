"""Sharded data parallelism (FSDP2, ``sharding.mode=fsdp``) keeps the exact global-batch update,
for every task: real worker processes, real gloo (FSDP2 runs on CPU), real data.

For each task, with dropout off and one seed, ``cluster.ranks=1`` (DDP, 32 samples per step)
is the reference, and ONE sharded run must log the reference loss at every step:

- steps 1-10: FSDP on 2 ranks at ``[24, 8]`` with ``balance.max_micro_batch=5`` (gradient
  accumulation on both ranks: 5 and 2 passes, evened out to 5 passes each, the small rank
  padding with zero-weight passes) and ``sharding.activation_checkpointing=true``;
- bert goes on (the resumes do not depend on the model: one task's chain, the others stop at
  step 10): steps 11-15 resumed on 3 ranks, still FSDP: the sharded checkpoint the 2 ranks
  wrote (``torch.distributed.checkpoint``, one file per rank) is resharded onto 3 as it is
  read; steps 16-20 resumed on 2 ranks under DDP (``sharding.mode=none``), every rank reading
  the sharded checkpoint whole.

A BERT run with ``sharding.checkpoint=full`` (gathered to rank 0, one file) resumes the same way.

Tolerance 1e-5 relative, as for every exactness test (measured: below 1e-7 for BERT).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hetseq_hpc.train.checkpoint.manager import load_checkpoint
from hetseq_hpc.train.checkpoint.shards import full_state, shard_dir_of
from tests.helpers.runs import SMALL_MODEL, assert_same_losses, hetseq, losses
from tests.helpers.tasks import task_overrides

pytestmark = pytest.mark.slow

STEPS = [
    "trainer.global_batch_size=32",
    "optim.schedule_steps=20",
    "trainer.checkpoint_every=5",
    "trainer.seed=7",
    "task.model.dropout=0.0",
    "trainer.val_every=0",
]
FSDP_UNEVEN = [
    "sharding.mode=fsdp",
    "cluster.ranks=2",
    "balance.allocation=[24,8]",
    "balance.max_micro_batch=5",
    "sharding.activation_checkpointing=true",
]


def _ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("name", ["bert", "image", "translation", "custom"])
def test_fsdp_uneven_then_3_ranks_then_ddp_repeat_one_rank(
    name, tmp_path, run_cli, task_data_files
):
    task = (
        [*SMALL_MODEL, "task.model.max_seq_len=32"]
        if name == "bert"
        else task_overrides(name, task_data_files)
    )
    ref, run = tmp_path / "ref", tmp_path / "sharded"
    last = 20 if name == "bert" else 10
    # bert and custom shard each unit alone; image and translation (and bert's 3-rank resume)
    # group them as sharding.units=auto does where a replica fits: the same losses either way
    units = "per_unit" if name in ("bert", "custom") else "auto"
    _ok(run_cli(ref, *task, *STEPS, "cluster.ranks=1", f"trainer.max_steps={last}", small=False))
    _ok(
        run_cli(
            run, *task, *STEPS, *FSDP_UNEVEN, f"sharding.units={units}", "trainer.max_steps=10",
            small=False,
        )
    )  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sharding"]["mode"] == "fsdp" and summary["sharding"]["units"] >= 1
    grouped = units == "auto" and summary["sharding"]["units"] > 1
    assert summary["sharding"]["units_grouped"] is grouped, summary["sharding"]
    # written sharded (DCP): each of the 2 ranks its own file
    shards = sorted((run / "checkpoints").glob("step_00000010.*.shards"))
    assert len(shards) == 1 and len(list(shards[0].glob("__*_*.distcp"))) == 2
    assert summary["exact"] is True
    if name == "bert":
        resumes = (
            (
                "sharding.mode=fsdp",
                "sharding.units=auto",
                "cluster.ranks=3",
                "balance.allocation=null",
                15,
            ),
            ("sharding.mode=none", "cluster.ranks=2", 20),
        )
        for *overrides, steps in resumes:
            _ok(run_cli(run, *task, *STEPS, *overrides, f"trainer.max_steps={steps}", small=False))
        log = (run / "logs" / "rank0.log").read_text()
        assert "on 3 ranks" in log and "FSDP2: 2 units + root" in log  # per unit, 2 ranks
        assert "FSDP2: 2 units in one group + root" in log  # grouped (auto), 3 ranks
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, last + 1))
    assert_same_losses(losses(ref), resumed, range(1, last + 1))


#: bf16 runs against the bf16 1-rank run, per step, relative: the bf16 tolerance of
#: test_precision_runs.py (MIXED_REL_TOL: bf16's unit roundoff 2**-8 over ~300 independent
#: per-token losses of a global batch, 3.9e-3 / sqrt(300) = 2.3e-4, rounded up)
BF16_REL_TOL = 2.5e-4


def test_bf16_fsdp_gathers_bf16_and_tracks_the_bf16_one_rank_run(tmp_path, run_cli):
    """Every rank in bf16: FSDP2 gathers the parameters in bf16 (half the bytes), the shards
    and the gradient reduce-scatter stay fp32; the uneven FSDP run (5 passes each, zero-weight
    padding) tracks the bf16 1-rank (DDP) run within bf16's tolerance, and summary.json says
    which dtype was gathered and why. A mixed precision per rank keeps fp32 gathers."""
    task = [*SMALL_MODEL, "task.model.max_seq_len=32"]
    bf16 = [*STEPS, "precision.default=bf16"]
    ref, run, mixed = tmp_path / "ref", tmp_path / "sharded", tmp_path / "mixed"
    _ok(run_cli(ref, *task, *bf16, "cluster.ranks=1", "trainer.max_steps=8", small=False))
    _ok(run_cli(run, *task, *bf16, *FSDP_UNEVEN, "trainer.max_steps=8", small=False))
    sharding = json.loads((run / "summary.json").read_text())["sharding"]
    assert sharding["all_gather_dtype"] == "bf16" and sharding["reduce_dtype"] == "fp32"
    assert "every rank computes in bf16" in sharding["all_gather_dtype_why"]
    a, b = losses(ref), losses(run)
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        rel = abs(a[step] - b[step]) / abs(a[step])
        assert rel <= BF16_REL_TOL, f"step {step}: {b[step]} vs {a[step]} (relative {rel:.2e})"
    _ok(
        run_cli(
            mixed,
            *task,
            *bf16,
            *FSDP_UNEVEN,
            "precision.ranks=[bf16,fp32]",
            "trainer.max_steps=1",
            small=False,
        )
    )
    sharding = json.loads((mixed / "summary.json").read_text())["sharding"]
    assert sharding["all_gather_dtype"] == "fp32"
    assert "bf16/fp32" in sharding["all_gather_dtype_why"]
    assert "parameters all-gathered in fp32" in (mixed / "logs" / "rank0.log").read_text()


#: a model whose state outweighs one sample's activations (short rows, small vocabulary):
#: ~681 k parameters, a replica with AdamW 13.6 MB, a shard on 2 ranks with FSDP2's gathered
#: units (root x 2 + block x 3) 8.3 MB, ~0.8 MiB of activations per sample
MIXED_MODEL = [
    "task.model.hidden_size=128",
    "task.model.num_layers=4",
    "task.model.num_heads=2",
    "task.model.intermediate_size=256",
    "task.model.max_seq_len=16",
    "task.data.vocab_size=1024",
]


def test_a_model_ddp_refuses_trains_sharded_auto_chooses_and_export(tmp_path, run_cli):
    """A mixed memory budget emulated on CPU (``cluster.memory_budgets_gb=[0.013, 1]``: one
    small rank of 13.3 MiB, one roomy rank of 1 GiB): the small rank cannot hold a replica's
    weights, gradients and AdamW state (5 fp32 copies, 13.6 MB) but holds its shard with the
    units FSDP2 gathers (8.3 MB) and a few samples. DDP is refused with a line that says to
    shard; ``auto`` picks FSDP there, which trains, and each rank's measured peak (torch's CPU
    allocations, recorded by the profiler: :mod:`hetseq_hpc.balance.peak`) is within its
    budget, both in ``summary.json`` and in the rank's log; ``auto`` picks DDP with room to
    spare. (``auto`` resolves to the same FSDP run as ``sharding.mode=fsdp``: one run for
    both, the choice itself unit-tested in tests/unit/test_sharding.py.)"""
    common = [*MIXED_MODEL, "cluster.ranks=2", "trainer.max_steps=2", "trainer.val_every=0"]
    mixed = ["cluster.memory_budgets_gb=[0.013,1]"]  # planned with 0.9 of each
    refused = run_cli(tmp_path / "ddp", *common, *mixed, "sharding.mode=none", small=False)
    # refused before anything starts (from the configured model's parameter count: exit 2),
    # or at start-up (from the built model: exit 1); either way the line says to shard
    assert refused.returncode in (1, 2), refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("hetseq-hpc: error:") and "sharding.mode=fsdp" in last, last
    assert "memory_budgets_gb[0]" in last, last  # the small rank, named
    for name, extra in (
        ("fsdp", ["sharding.mode=auto", *mixed]),
        ("auto_roomy", ["sharding.mode=auto"]),
    ):
        _ok(run_cli(tmp_path / name, *common, *extra, small=False))
    summaries = {
        d: json.loads((tmp_path / d / "summary.json").read_text()) for d in ("fsdp", "auto_roomy")
    }
    assert [s["sharding"]["mode"] for s in summaries.values()] == ["fsdp", "ddp"]
    for name in ("fsdp",):
        memory = summaries[name]["memory"]
        assert [m["budget_bytes"] for m in memory] == [0.013 * 2**30, 2.0**30]
        for rank, m in enumerate(memory):
            assert m["peak_measure"].startswith("torch_cpu_allocations"), m
            # the bar: every rank's measured peak (calibration, training and the final
            # checkpoint) within its budget, above the state it holds
            assert m["state_bytes"] < m["measured_peak_bytes"] <= m["budget_bytes"], (rank, m)
        log = (tmp_path / name / "logs" / "rank0.log").read_text()
        assert "rank 0 memory: measured peak" in log and "of its budget 13.31 MiB" in log
    # the sharded run's model, consolidated for inference: every tensor of its checkpoint
    proc = hetseq("export", str(tmp_path / "fsdp"), "--out", str(tmp_path / "m.safetensors"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = load_file(tmp_path / "m.safetensors")
    record = sorted((tmp_path / "fsdp" / "checkpoints").glob("*.pt"))[-1]
    state = load_checkpoint(record)
    model = full_state(shard_dir_of(record, state), [], optimizer=False)["model"]
    assert sorted(exported) == sorted(model)
    assert all(torch.equal(exported[k], model[k]) for k in model)
    empty = hetseq("export", str(tmp_path / "nothing-here"))
    assert empty.returncode != 0 and "hetseq-hpc: error:" in empty.stderr


def test_fsdp_full_checkpoints_resume_on_3_ranks(tmp_path, run_cli):
    """``sharding.checkpoint=full``: the state gathered to rank 0 in one file, as DDP writes it."""
    task = [*SMALL_MODEL, "task.model.max_seq_len=32"]
    ref, run = tmp_path / "ref", tmp_path / "full"
    _ok(run_cli(ref, *task, *STEPS, "cluster.ranks=1", "trainer.max_steps=10", small=False))
    _ok(
        run_cli(
            run,
            *task,
            *STEPS,
            *FSDP_UNEVEN,
            "sharding.checkpoint=full",
            "trainer.max_steps=5",
            small=False,
        )
    )
    assert not list((run / "checkpoints").glob("*.shards"))
    assert load_checkpoint(run / "checkpoints" / "step_00000005.pt")["model"]
    _ok(
        run_cli(
            run,
            *task,
            *STEPS,
            "sharding.mode=fsdp",
            "cluster.ranks=3",
            "balance.allocation=null",
            "trainer.max_steps=10",
            small=False,
        )
    )
    assert_same_losses(losses(ref), losses(run), range(1, 11))


def test_ddp_checkpoint_resumes_under_fsdp_on_3_ranks(tmp_path, run_cli):
    """The other direction of a mode change: a DDP run (2 ranks at [24, 8], its one-file
    checkpoint) resumed at step 5 under ``sharding.mode=fsdp`` on 3 ranks, each rank taking its
    shard of the whole state as it loads, logs the 1-rank loss at all 10 steps."""
    task = [*SMALL_MODEL, "task.model.max_seq_len=32"]
    ref, run = tmp_path / "ref", tmp_path / "ddp_then_fsdp"
    _ok(run_cli(ref, *task, *STEPS, "cluster.ranks=1", "trainer.max_steps=10", small=False))
    _ok(
        run_cli(
            run,
            *task,
            *STEPS,
            "cluster.ranks=2",
            "balance.allocation=[24,8]",
            "trainer.max_steps=5",
            small=False,
        )
    )
    _ok(
        run_cli(
            run,
            *task,
            *STEPS,
            "sharding.mode=fsdp",
            "cluster.ranks=3",
            "balance.allocation=null",
            "trainer.max_steps=10",
            small=False,
        )
    )
    assert json.loads((run / "summary.json").read_text())["sharding"]["mode"] == "fsdp"
    assert sorted(losses(run)) == list(range(1, 11))
    assert_same_losses(losses(ref), losses(run), range(1, 11))


@pytest.mark.parametrize("name", ["bert", "translation"])
def test_fsdp_validation_matches_one_rank(name, tmp_path, run_cli, task_data_files):
    """Validation under FSDP: BERT (one forward per batch) on the shards, every rank running as
    many batches (2 ranks at [24, 8] have different micro-batches); translation with BLEU
    (greedy decoding, a data-dependent number of passes) on the weights gathered whole. The
    metrics equal the 1-rank run's, and translation's examples come from rank 0's CPU copy."""
    task = (
        [*SMALL_MODEL, "task.model.max_seq_len=32"]
        if name == "bert"
        else task_overrides(name, task_data_files)
    )
    common = [*task, *STEPS, "trainer.val_every=5", "trainer.max_steps=10"]
    ref, run = tmp_path / "ref", tmp_path / "sharded"
    _ok(run_cli(ref, *common, "cluster.ranks=1", small=False))
    _ok(run_cli(run, *common, *FSDP_UNEVEN, small=False))
    rows = {
        d: [
            r
            for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r
        ]
        for d in (ref, run)
    }
    assert [r["step"] for r in rows[run]] == [5, 10]
    for a, b in zip(rows[ref], rows[run]):
        for key in (k for k in a if k.startswith("val_")):
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1.0), (key, a[key], b[key])
    if name == "translation":
        assert json.loads((run / "summary.json").read_text()).get("examples")
