"""``trainer.compile=on`` keeps the exact global-batch update: real worker processes, real gloo,
real ``torch.compile`` (inductor, on the CPU), real data.

For each task, with dropout off in fp32, ``cluster.ranks=1`` eager (32 samples per step) is the
reference, and ONE run of 2 ranks at ``[24, 8]`` with gradient accumulation (micro-batches of
at most 4 samples) must log its loss at every step within 1e-6 relative:

- bert: steps 1-3 compiled under DDP (the units compiled in place: the checkpoint is the eager
  one's), steps 4-6 resumed eager (``trainer.compile=off``), steps 7-9 resumed compiled under
  FSDP2 (``sharding.mode=fsdp``): both switches of a resume;
- image: steps 1-3 compiled under FSDP2; translation (torch.nn's own encoder layers, whose
  ``forward`` is compiled): steps 1-3 compiled under DDP. One leg each: a compiled leg costs a
  minute of compiling on the 2-core machine, and what a resume switches is bert's chain.

The compile is logged with the graphs it made (bounded: a graph per micro-batch size at most).
"""

from __future__ import annotations

import itertools
import json
import re

import pytest

from tests.helpers.runs import SMALL_MODEL, losses
from tests.helpers.tasks import task_overrides

pytestmark = pytest.mark.slow

COMMON = [
    "trainer.global_batch_size=32",
    "optim.schedule_steps=20",
    "trainer.checkpoint_every=3",
    "trainer.seed=7",
    "task.model.dropout=0.0",
    "trainer.val_every=0",
]
UNEVEN = ["cluster.ranks=2", "balance.allocation=[24,8]", "balance.max_micro_batch=4"]
#: the legs of each task's run: (overrides, last step)
LEGS = {
    "bert": [
        (["trainer.compile=on"], 3),
        (["trainer.compile=off"], 6),
        (["trainer.compile=on", "sharding.mode=fsdp"], 9),
    ],
    "image": [(["trainer.compile=on", "sharding.mode=fsdp"], 3)],
    "translation": [(["trainer.compile=on"], 3)],
}
#: fp32, dropout off: a compiled pass sums in another order than the eager one (measured
#: 1e-8..1e-7 relative for the small BERT)
TOL = 1e-6


def _ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("name", ["bert", "image", "translation"])
def test_compiled_runs_and_resumes_repeat_one_eager_rank(name, tmp_path, run_cli, task_data_files):
    task = (
        [*SMALL_MODEL, "task.model.max_seq_len=32"]
        if name == "bert"
        else task_overrides(name, task_data_files)
    )
    legs = LEGS[name]
    last = legs[-1][1]
    ref, run = tmp_path / "ref", tmp_path / "compiled"
    _ok(run_cli(ref, *task, *COMMON, "cluster.ranks=1", f"trainer.max_steps={last}", small=False))
    for overrides, steps in legs:
        _ok(
            run_cli(
                run, *task, *COMMON, *UNEVEN, *overrides, f"trainer.max_steps={steps}", small=False
            )
        )
    want, got = losses(ref), losses(run)
    assert sorted(got) == list(range(1, last + 1))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= TOL, {s: (want[s], got[s]) for s in want}
    # every compiled leg compiled in its first step and logged it; an eager leg compiled
    # nothing; at most a graph per micro-batch size (4 and, with FSDP's padding passes, 1)
    log = (run / "logs" / "rank0.log").read_text()
    compiled_legs = [1] + [
        prev + 1 for (_, prev), (o, _) in itertools.pairwise(legs) if "trainer.compile=on" in o
    ]
    assert log.count("trainer.compile=on: ") == len(compiled_legs), log[-3000:]
    made = [int(n) for n in re.findall(r"step (\d+): compiled \d+ graph", log)]
    assert made == compiled_legs, made
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    counted = [r["compiled_graphs"] for r in rows if "compiled_graphs" in r]
    assert counted and max(counted) <= 2, counted


def test_a_rebalance_that_changes_the_micro_batch_compiles_a_bounded_number_of_graphs(
    tmp_path, token_cache, caplog
):
    """In-process, one CPU rank: micro-batches of 8, then 4, 3 and 2 samples (as re-balancing
    would set them). The first size compiles a graph, the first change one more (the batch
    dimension becomes dynamic), later sizes none; each compile is logged with its step."""
    from hetseq_hpc.balance.allocation import allocate
    from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
    from tests.helpers.trainers import one_rank_trainer

    made = []
    with single_process_rendezvous() as rdv, caplog.at_level("INFO"):
        trainer = one_rank_trainer(tmp_path, rdv, token_cache, "trainer.compile=on", cap=8)
        assert trainer.compiled
        for step, cap in enumerate((8, 4, 3, 2), 1):
            trainer.allocation = allocate([1.0], 8, [cap])
            rec = trainer.train_step(step)
            trainer.count_graphs(rec)
            made.append(rec.extra.get("compiled_graphs"))
    assert made == [1, 2, None, None], made
    said = [r.getMessage() for r in caplog.records if "graph(s)" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["step 1", "step 2"], said
